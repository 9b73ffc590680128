// Command samplerd-example runs the Go kit end to end against a running
// samplerd:
//
//	samplerd-example [-addr] [127.0.0.1:50051]
//
// Generate needs a server started with --model.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/samplerd/samplerd/clients/go/samplerdclient"
	pb "github.com/samplerd/samplerd/gen/go/samplerd/v1"
)

func main() {
	defAddr := os.Getenv("SAMPLERD_ADDR")
	if defAddr == "" {
		defAddr = "127.0.0.1:50051"
	}
	addr := flag.String("addr", defAddr, "samplerd address (host:port); also taken as the one plain argument")
	flag.Parse()
	switch flag.NArg() {
	case 0:
	case 1:
		*addr = flag.Arg(0)
	default:
		log.Fatalf("one address expected, got %q", flag.Args())
	}

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// grpc.WithInsecure: plaintext, as for a loopback server (TLS:
	// grpc.WithTransportCredentials(credentials.NewClientTLSFromFile(...))).
	// DialOptions: round_robin and the retry policy (clients/service-config.json).
	opts := append(samplerdclient.DialOptions(), grpc.WithInsecure(), grpc.WithBlock())
	conn, err := grpc.DialContext(ctx, samplerdclient.Target(*addr), opts...)
	if err != nil {
		log.Fatalf("connect %s: %v", *addr, err)
	}
	defer conn.Close()
	c := pb.NewSamplerClient(conn)

	// 1. Sample with raw little-endian f32 bytes: greedy picks token 3.
	logits := []float32{0.5, 1.0, -2.0, 4.25, 3.0, 0.0}
	r, err := samplerdclient.Sample(ctx, c, logits,
		&pb.SamplingParams{Temperature: proto.Float32(0), Seed: proto.Uint64(18446744073709551557)}, 0)
	if err != nil {
		log.Fatal(samplerdclient.Describe(err))
	}
	fmt.Printf("Sample: token %d (p=%.3f, logprob=%.3f), seed %d\n", r.TokenId, r.Probability, r.Logprob, r.Seed)

	// 2. SampleStream: three steps of one sequence; the server keeps the
	//    penalty window, so repeat_penalty turns 0, 1, 0.
	s, err := samplerdclient.OpenStream(ctx, c, &pb.SamplingParams{Temperature: proto.Float32(0), RepeatPenalty: proto.Float32(2)}, nil, 0)
	if err != nil {
		log.Fatal(samplerdclient.Describe(err))
	}
	for i := 0; i < 3; i++ {
		r, err := s.Step([]float32{5.0, 4.9, 1.0, 0.0})
		if err != nil {
			log.Fatal(samplerdclient.Describe(err))
		}
		fmt.Printf("SampleStream step %d: token %d\n", r.Step, r.TokenId)
	}
	if err := s.Close(); err != nil {
		log.Fatal(samplerdclient.Describe(err))
	}

	// 3. Generate with a deadline, printing text as it streams; then one
	//    cancelled by the client after 3 tokens.
	req := &pb.GenerateRequest{
		Messages:  []*pb.ChatMessage{{Role: "user", Content: "Name three colours."}},
		MaxTokens: proto.Uint32(24),
		Params:    &pb.SamplingParams{Seed: proto.Uint64(7)},
	}
	genCtx, genCancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer genCancel()
	_, fin, err := samplerdclient.Generate(genCtx, c, req, func(t *pb.Token) bool { fmt.Print(t.Text); return true })
	if err != nil {
		log.Fatal(samplerdclient.Describe(err))
	}
	fmt.Printf("%s\nGenerate: %s, %d tokens, seed %d\n", fin.Text, fin.FinishReason, fin.Usage.GetCompletionTokens(), fin.Seed)
	req.MaxTokens, req.IgnoreEos = proto.Uint32(200), true
	n := 0
	tokens, _, err := samplerdclient.Generate(genCtx, c, req, func(*pb.Token) bool { n++; return n < 3 })
	if status.Code(err) != codes.Canceled {
		log.Fatalf("expected CANCELLED, got %v", err)
	}
	fmt.Printf("Generate cancelled after %d tokens: %s\n", len(tokens), status.Code(err))

	// 4. A bad request and its rich error details.
	_, err = samplerdclient.Sample(ctx, c, logits, &pb.SamplingParams{TopP: proto.Float32(1.5)}, 0)
	fmt.Printf("Sample top_p=1.5 refused:\n%s\n", samplerdclient.Describe(err))
}
