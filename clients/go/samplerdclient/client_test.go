package samplerdclient

// Tests against a running samplerd started with a model: SAMPLERD_ADDR
// names it (scripts/ci/clients.sh go starts one and runs these).

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "github.com/samplerd/samplerd/gen/go/samplerd/v1"
)

func client(t *testing.T) pb.SamplerClient {
	t.Helper()
	addr := os.Getenv("SAMPLERD_ADDR")
	if addr == "" {
		t.Fatal("SAMPLERD_ADDR is not set: point it at a samplerd started with --model (scripts/ci/clients.sh does)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	opts := append(DialOptions(), grpc.WithInsecure(), grpc.WithBlock())
	conn, err := grpc.DialContext(ctx, Target(addr), opts...)
	if err != nil {
		t.Fatalf("connect %s: %v", addr, err)
	}
	t.Cleanup(func() { conn.Close() })
	return pb.NewSamplerClient(conn)
}

func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// A vocabulary-sized vector whose maximum (at best) is only slightly above
// the rest: the default temperature and top_k would almost never draw it,
// so picking it shows temperature 0 reached the server.
const nVocab, best = 32000, 12345

func flatLogits() []float32 {
	x := make([]float32, nVocab)
	for i := range x {
		x[i] = float32((i*7919)%1000) / 1000
	}
	x[best] = 1.5
	return x
}

func TestF32LE(t *testing.T) {
	got := F32LE([]float32{1.0, -2.5})
	want := []byte{0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x20, 0xc0}
	if string(got) != string(want) {
		t.Fatalf("F32LE = % x, want % x", got, want)
	}
}

func TestSampleRawBytes(t *testing.T) {
	c := client(t)
	const seed = uint64(18446744073709551557)
	r, err := c.Sample(ctxFor(t, 10*time.Second), &pb.SampleRequest{
		LogitsF32Le: F32LE(flatLogits()),
		Params:      &pb.SamplingParams{Temperature: proto.Float32(0), Seed: proto.Uint64(seed)},
		Step:        5,
		NProbs:      3,
	})
	if err != nil {
		t.Fatal(Describe(err))
	}
	if r.TokenId != best || r.Seed != seed || r.Step != 5 {
		t.Fatalf("token %d seed %d step %d, want %d %d 5", r.TokenId, r.Seed, r.Step, best, seed)
	}
	if len(r.Probs) != 3 || r.Probs[0].TokenId != best || r.Logprob >= 0 {
		t.Fatalf("probs %v logprob %v", r.Probs, r.Logprob)
	}
	// The helper sends the same bytes; the repeated-float field is the
	// same request.
	a, err := Sample(ctxFor(t, 10*time.Second), c, flatLogits(), &pb.SamplingParams{Seed: proto.Uint64(3)}, 2)
	if err != nil {
		t.Fatal(Describe(err))
	}
	b, err := c.Sample(ctxFor(t, 10*time.Second), &pb.SampleRequest{Logits: flatLogits(), Params: &pb.SamplingParams{Seed: proto.Uint64(3)}, Step: 2})
	if err != nil {
		t.Fatal(Describe(err))
	}
	if !proto.Equal(a, b) {
		t.Fatalf("bytes %v != floats %v", a, b)
	}
}

func TestSharedRowsAnswerAsInlineRows(t *testing.T) {
	c := client(t)
	ctx := ctxFor(t, 10*time.Second)
	name := fmt.Sprintf("samplerd-go-test-%d", os.Getpid())
	s, err := CreateSharedRows(ctx, c, name, 2, len(flatLogits()))
	if err != nil {
		t.Fatal(Describe(err))
	}
	copy(s.Row(1), flatLogits())
	params := &pb.SamplingParams{Seed: proto.Uint64(9)}
	shared, err := c.Sample(ctx, &pb.SampleRequest{Shared: s.Ref(1), Params: params, Step: 4})
	if err != nil {
		t.Fatal(Describe(err))
	}
	inline, err := c.Sample(ctx, &pb.SampleRequest{LogitsF32Le: F32LE(flatLogits()), Params: params, Step: 4})
	if err != nil {
		t.Fatal(Describe(err))
	}
	if !proto.Equal(shared, inline) {
		t.Fatalf("shared %v != inline %v", shared, inline)
	}
	if err := s.Close(ctx, c); err != nil {
		t.Fatal(Describe(err))
	}
	if _, err := os.Stat(s.Path); !os.IsNotExist(err) {
		t.Fatalf("%s still exists: %v", s.Path, err)
	}
}

func TestSparseRow(t *testing.T) {
	row, err := SparseRow([]float32{0.5, 3.0, float32(math.Inf(-1)), 2.0, 1.0}, 2)
	if err != nil {
		t.Fatal(err)
	}
	wantRest := math.Log(math.Exp(0.5) + math.Exp(1.0))
	if fmt.Sprint(row.Ids, row.Values) != "[1 3] [3 2]" || math.Abs(row.RestLogsumexp-wantRest) > 1e-12 || row.VocabSize != 5 {
		t.Fatalf("SparseRow = %v", row)
	}
	if all, _ := SparseRow([]float32{1, 2}, 2); !math.IsInf(all.RestLogsumexp, -1) {
		t.Fatalf("nothing unsent: rest %v", all.RestLogsumexp)
	}
	if _, err := SparseRow([]float32{1}, 2); err == nil {
		t.Fatal("n above the row's length was taken")
	}
	// The default chain answers the top 1,024 as it answers the whole row.
	c := client(t)
	params := &pb.SamplingParams{Seed: proto.Uint64(11)}
	dense, err := c.Sample(ctxFor(t, 10*time.Second), &pb.SampleRequest{LogitsF32Le: F32LE(flatLogits()), Params: params, Step: 1, NProbs: 4})
	if err != nil {
		t.Fatal(Describe(err))
	}
	top, _ := SparseRow(flatLogits(), 1024)
	sparse, err := c.Sample(ctxFor(t, 10*time.Second), &pb.SampleRequest{Sparse: top, Params: params, Step: 1, NProbs: 4})
	if err != nil {
		t.Fatal(Describe(err))
	}
	if sparse.TokenId != dense.TokenId || sparse.Probability != dense.Probability || math.Abs(float64(sparse.Logprob-dense.Logprob)) > 1e-6 {
		t.Fatalf("sparse %v, dense %v", sparse, dense)
	}
	for i := range dense.Probs {
		if sparse.Probs[i].TokenId != dense.Probs[i].TokenId {
			t.Fatalf("probs: sparse %v, dense %v", sparse.Probs, dense.Probs)
		}
	}
}

func TestSampleStream(t *testing.T) {
	c := client(t)
	s, err := OpenStream(ctxFor(t, 30*time.Second), c,
		&pb.SamplingParams{Temperature: proto.Float32(0), RepeatPenalty: proto.Float32(2), Seed: proto.Uint64(11)}, nil, 10)
	if err != nil {
		t.Fatal(Describe(err))
	}
	logits := []float32{5.0, 4.9, 1.0, 0.0}
	// 0 wins, then is penalised (5.0/2 < 4.9) so 1 wins, then both are
	// (2.5 > 2.45) and 0 wins again: the server kept the window.
	wantTokens := []uint32{0, 1, 0}
	for i, want := range wantTokens {
		r, err := s.Step(logits)
		if err != nil {
			t.Fatal(Describe(err))
		}
		if r.Step != uint64(10+i) || r.TokenId != want || r.Seed != 11 {
			t.Fatalf("step %d: got step %d token %d seed %d, want step %d token %d", i, r.Step, r.TokenId, r.Seed, 10+i, want)
		}
	}
	if err := s.Close(); err != nil {
		t.Fatal(Describe(err))
	}
}

func prompt(maxTokens uint32) *pb.GenerateRequest {
	return &pb.GenerateRequest{
		Messages:  []*pb.ChatMessage{{Role: "user", Content: "Count from one to ten."}},
		MaxTokens: proto.Uint32(maxTokens),
		IgnoreEos: true,
		Params:    &pb.SamplingParams{Seed: proto.Uint64(7)},
	}
}

func TestGenerateWithDeadline(t *testing.T) {
	c := client(t)
	var seen int
	tokens, fin, err := Generate(ctxFor(t, 60*time.Second), c, prompt(6), func(*pb.Token) bool { seen++; return true })
	if err != nil {
		t.Fatal(Describe(err))
	}
	if len(tokens) != 6 || seen != 6 || fin.FinishReason != pb.FinishReason_MAX_TOKENS ||
		fin.Usage.GetCompletionTokens() != 6 || fin.Usage.GetPromptTokens() == 0 || fin.Seed != 7 {
		t.Fatalf("%d tokens (%d seen), finished %v", len(tokens), seen, fin)
	}
}

func TestGenerateCancel(t *testing.T) {
	c := client(t)
	n := 0
	tokens, fin, err := Generate(ctxFor(t, 60*time.Second), c, prompt(500), func(*pb.Token) bool { n++; return n < 3 })
	if status.Code(err) != codes.Canceled || fin != nil || len(tokens) != 3 {
		t.Fatalf("err %v, finished %v, %d tokens; want CANCELLED after 3", err, fin, len(tokens))
	}
	// The server keeps serving.
	tokens, fin, err = Generate(ctxFor(t, 60*time.Second), c, prompt(2), nil)
	if err != nil || len(tokens) != 2 || fin.FinishReason != pb.FinishReason_MAX_TOKENS {
		t.Fatalf("after the cancel: err %v, %d tokens, finished %v", err, len(tokens), fin)
	}
}

func TestGeneratePastDeadline(t *testing.T) {
	c := client(t)
	_, _, err := Generate(ctxFor(t, 300*time.Millisecond), c, prompt(2000), nil)
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("err %v, want DEADLINE_EXCEEDED", err)
	}
}

// checkRefusal checks err is INVALID_ARGUMENT with the rich error model:
// ErrorInfo{reason, domain samplerd.v1} and a BadRequest violation on field.
func checkRefusal(t *testing.T, err error, field, reason string) ErrorDetails {
	t.Helper()
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("err %v, want INVALID_ARGUMENT", err)
	}
	if leaf := field[strings.LastIndex(field, ".")+1:]; !strings.Contains(status.Convert(err).Message(), leaf) {
		t.Fatalf("message %q does not name %s", status.Convert(err).Message(), leaf)
	}
	d, ok := Details(err)
	if !ok {
		t.Fatalf("no grpc-status-details-bin: %s", Describe(err))
	}
	if d.Code != codes.InvalidArgument || d.Info == nil || d.Info.Domain != "samplerd.v1" || d.Info.Reason != reason {
		t.Fatalf("details: %s", Describe(err))
	}
	for _, v := range d.BadRequest.GetFieldViolations() {
		if v.Field == field {
			return d
		}
	}
	t.Fatalf("no field violation on %s: %s", field, Describe(err))
	return d
}

func TestErrorDetails(t *testing.T) {
	c := client(t)
	for _, tc := range []struct {
		field  string
		params *pb.SamplingParams
	}{
		{"params.top_p", &pb.SamplingParams{TopP: proto.Float32(1.5)}},
		{"params.temperature", &pb.SamplingParams{Temperature: proto.Float32(-1)}},
	} {
		_, err := Sample(ctxFor(t, 10*time.Second), c, flatLogits(), tc.params, 0)
		checkRefusal(t, err, tc.field, "SAMPLERD_PARAM_OUT_OF_RANGE")
	}
}

func TestErrorDetailsOnAStream(t *testing.T) {
	c := client(t)
	// A streaming call's error carries the same trailer.
	req := prompt(3)
	req.Params.TopP = proto.Float32(1.5)
	_, _, err := Generate(ctxFor(t, 30*time.Second), c, req, nil)
	checkRefusal(t, err, "params.top_p", "SAMPLERD_PARAM_OUT_OF_RANGE")
}

func TestErrorDetailsUnknownStage(t *testing.T) {
	c := client(t)
	params := &pb.SamplingParams{Chain: []*pb.StageSpec{{Name: "no_such_stage"}}}
	_, err := Sample(ctxFor(t, 10*time.Second), c, flatLogits(), params, 0)
	d := checkRefusal(t, err, "params.chain", "SAMPLERD_UNKNOWN_STAGE")
	if d.Resource.GetResourceName() != "no_such_stage" {
		t.Fatalf("resource: %s", Describe(err))
	}
}

// The embedded service config is the shared one: round_robin, and the
// retry policy on exactly the idempotent RPCs. (Every test above dials
// with it, which grpc-go refuses for an invalid config.)
func TestServiceConfigRetriesTheIdempotentRPCs(t *testing.T) {
	var cfg struct {
		LoadBalancingConfig []map[string]interface{} `json:"loadBalancingConfig"`
		MethodConfig        []struct {
			Name []struct {
				Service string `json:"service"`
				Method  string `json:"method"`
			} `json:"name"`
			RetryPolicy struct {
				RetryableStatusCodes []string `json:"retryableStatusCodes"`
			} `json:"retryPolicy"`
		} `json:"methodConfig"`
	}
	if err := json.Unmarshal([]byte(ServiceConfig), &cfg); err != nil {
		t.Fatalf("service config: %v", err)
	}
	if len(cfg.LoadBalancingConfig) != 1 || cfg.LoadBalancingConfig[0]["round_robin"] == nil {
		t.Fatalf("loadBalancingConfig = %v, want round_robin", cfg.LoadBalancingConfig)
	}
	var names []string
	for _, n := range cfg.MethodConfig[0].Name {
		names = append(names, n.Service+"/"+n.Method)
	}
	want := "samplerd.v1.Sampler/Sample samplerd.v1.Sampler/SampleBatch samplerd.v1.Sampler/ListStages " +
		"samplerd.v1.Sampler/Tokenize samplerd.v1.Sampler/Detokenize samplerd.v1.Sampler/GetServerInfo " +
		"grpc.health.v1.Health/Check"
	if strings.Join(names, " ") != want {
		t.Fatalf("retried methods %v, want %s", names, want)
	}
	if got := strings.Join(cfg.MethodConfig[0].RetryPolicy.RetryableStatusCodes, " "); got != "UNAVAILABLE RESOURCE_EXHAUSTED" {
		t.Fatalf("retryable codes %s", got)
	}
}
