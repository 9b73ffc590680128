// Command every_rpc calls every samplerd.v1.Sampler RPC once, with plain
// grpc-go (no kit). It builds with Debian's grpc-go 1.33 as with a current
// one (grpc.WithInsecure and DialContext; 1.41+ also offers
// credentials/insecure and grpc.NewClient):
//
//	every_rpc [host:port]      # default $SAMPLERD_ADDR or 127.0.0.1:50051
//
// With `[auth]` on, set SAMPLERD_TOKEN. Generate, Tokenize and Detokenize
// need a server started with a model; the shared-memory rows, a client on
// the server's host.
package main

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"log"
	"math"
	"os"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "github.com/samplerd/samplerd/gen/go/samplerd/v1"
)

// f32le encodes logits as little-endian f32, whatever the host's order.
func f32le(xs []float32) []byte {
	b := make([]byte, 4*len(xs))
	for i, x := range xs {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	return b
}

func must(err error) {
	if err != nil {
		log.Fatal(err)
	}
}

func main() {
	addr := os.Getenv("SAMPLERD_ADDR")
	if len(os.Args) > 1 {
		addr = os.Args[1]
	}
	if addr == "" {
		addr = "127.0.0.1:50051"
	}
	addr = strings.TrimPrefix(addr, "http://")

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if token := os.Getenv("SAMPLERD_TOKEN"); token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
	}
	// grpc-go stops at 4 MiB received by default; a 256-row SampleBatch
	// with n_probs = 1024 answers 4.2 MB. Match limits.max_message_bytes.
	conn, err := grpc.DialContext(ctx, addr, grpc.WithInsecure(), grpc.WithBlock(),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20), grpc.MaxCallSendMsgSize(64<<20)))
	must(err)
	defer conn.Close()
	c := pb.NewSamplerClient(conn)

	logits := []float32{0.5, 1.0, -2.0, 4.25, 3.0, 0.0} // token 3 is the largest
	greedy := &pb.SamplingParams{Temperature: proto.Float32(0), Seed: proto.Uint64(7)}

	// GetServerInfo: version, model, limits; the request id comes back in a header.
	var header metadata.MD
	info, err := c.GetServerInfo(ctx, &pb.GetServerInfoRequest{}, grpc.Header(&header))
	must(err)
	fmt.Println("GetServerInfo:", info.GetVersion(), info.GetModel().GetFileName(), "request id", header.Get(info.GetRequestIdHeader()))

	stages, err := c.ListStages(ctx, &pb.ListStagesRequest{})
	must(err)
	fmt.Println("ListStages:", len(stages.GetStages()), "stages, default chain:", stages.GetDefaultChainDescription())

	r, err := c.Sample(ctx, &pb.SampleRequest{LogitsF32Le: f32le(logits), Params: greedy, NProbs: 2})
	must(err)
	if r.GetTokenId() != 3 {
		log.Fatalf("Sample: token %d", r.GetTokenId())
	}
	fmt.Println("Sample:", r.GetTokenId(), "seed", r.GetSeed())

	// SampleStream: one sequence; the server keeps its penalty window and step.
	s, err := c.SampleStream(ctx)
	must(err)
	must(s.Send(&pb.SampleStreamRequest{LogitsF32Le: f32le(logits),
		Params: &pb.SamplingParams{Temperature: proto.Float32(0), RepeatPenalty: proto.Float32(2)}}))
	var streamed []uint32
	for i := 0; i < 3; i++ {
		if i > 0 {
			must(s.Send(&pb.SampleStreamRequest{LogitsF32Le: f32le(logits)}))
		}
		m, err := s.Recv()
		must(err)
		streamed = append(streamed, m.GetTokenId())
	}
	must(s.CloseSend())
	fmt.Println("SampleStream:", streamed)

	// SampleBatch: many rows in one message, one dtype.
	var rows []*pb.BatchRow
	for i := 0; i < 4; i++ {
		row := make([]float32, len(logits))
		for j := range logits {
			row[(j+i)%len(logits)] = logits[j]
		}
		rows = append(rows, &pb.BatchRow{Logits: f32le(row)})
	}
	batch, err := c.SampleBatch(ctx, &pb.SampleBatchRequest{Rows: rows, Dtype: pb.LogitsDtype_LOGITS_DTYPE_F32LE, Params: greedy})
	must(err)
	var batched []uint32
	for _, m := range batch.GetRows() {
		batched = append(batched, m.GetTokenId())
	}
	fmt.Println("SampleBatch:", batched)

	// SampleBatchStream: many sequences, each keeps its state; Leave ends one.
	bs, err := c.SampleBatchStream(ctx)
	must(err)
	reversed := make([]float32, len(logits))
	for i, x := range logits {
		reversed[len(logits)-1-i] = x
	}
	must(bs.Send(&pb.SampleBatchStreamRequest{Dtype: pb.LogitsDtype_LOGITS_DTYPE_F32LE, Params: greedy,
		Rows: []*pb.BatchStreamRow{{SequenceId: 1, Logits: f32le(logits)}, {SequenceId: 2, Logits: f32le(reversed)}}}))
	must(bs.Send(&pb.SampleBatchStreamRequest{Dtype: pb.LogitsDtype_LOGITS_DTYPE_F32LE, Leave: []uint64{2},
		Rows: []*pb.BatchStreamRow{{SequenceId: 1, Logits: f32le(logits)}}}))
	must(bs.CloseSend())
	for {
		m, err := bs.Recv()
		if err == io.EOF {
			break
		}
		must(err)
		fmt.Println("SampleBatchStream: sequences", m.GetSequenceIds(), "rows", len(m.GetRows()))
	}

	// RegisterSharedMemory / UnregisterSharedMemory: on the server's host,
	// rows are read in place from a file in /dev/shm (writing through the
	// file is enough; a long-lived client maps it).
	path := fmt.Sprintf("/dev/shm/samplerd-example-%d", os.Getpid())
	must(os.WriteFile(path, f32le(logits), 0o600))
	defer os.Remove(path)
	name := fmt.Sprintf("example-%d", os.Getpid())
	_, err = c.RegisterSharedMemory(ctx, &pb.RegisterSharedMemoryRequest{Name: name, Path: path, ByteSize: uint64(4 * len(logits))})
	must(err)
	r, err = c.Sample(ctx, &pb.SampleRequest{Params: greedy, Shared: &pb.SharedLogits{Region: name, Count: uint32(len(logits))}})
	must(err)
	_, err = c.UnregisterSharedMemory(ctx, &pb.UnregisterSharedMemoryRequest{Name: name})
	must(err)
	fmt.Println("Sample from shared memory:", r.GetTokenId())

	if info.GetModel().GetFileName() != "" {
		tok, err := c.Tokenize(ctx, &pb.TokenizeRequest{Text: "Hello, world"})
		must(err)
		text, err := c.Detokenize(ctx, &pb.DetokenizeRequest{Tokens: tok.GetTokens()})
		must(err)
		if text.GetText() != "Hello, world" {
			log.Fatalf("Detokenize: %q", text.GetText())
		}
		fmt.Println("Tokenize:", tok.GetTokens(), "Detokenize:", text.GetText())

		// Generate: a server stream of Token messages, then one Finished.
		g, err := c.Generate(ctx, &pb.GenerateRequest{
			Messages:  []*pb.ChatMessage{{Role: "user", Content: "Say hi."}},
			MaxTokens: proto.Uint32(16),
			Params:    &pb.SamplingParams{Seed: proto.Uint64(7)},
		})
		must(err)
		for {
			m, err := g.Recv()
			if err == io.EOF {
				break
			}
			must(err)
			if t := m.GetToken(); t != nil {
				fmt.Print(t.GetText())
			} else if f := m.GetFinished(); f != nil {
				fmt.Printf("\nGenerate: %s, %d tokens, seed %d\n", f.GetFinishReason(), f.GetUsage().GetCompletionTokens(), f.GetSeed())
			}
		}
	}

	// Errors carry google.rpc details.
	_, err = c.Sample(ctx, &pb.SampleRequest{LogitsF32Le: f32le(logits), Params: &pb.SamplingParams{TopP: proto.Float32(1.5)}})
	st := status.Convert(err)
	if st.Code() != codes.InvalidArgument {
		log.Fatalf("top_p = 1.5: %v", err)
	}
	for _, d := range st.Details() {
		if bad, ok := d.(*errdetails.BadRequest); ok {
			fmt.Println("error:", st.Code(), bad.GetFieldViolations()[0].GetField())
		}
	}
}
