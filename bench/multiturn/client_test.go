package multiturn

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
)

// fakeChat is a scripted OpenAI-compatible chat server: it answers "answer <conv> <turn>" (in
// three SSE chunks, the first holding two words) and records every request.
type fakeChat struct {
	mu       sync.Mutex
	requests []recorded
	// reject, if set, decides which requests get HTTP 500.
	reject func(conv string, turn int) bool
	// hold, if set, is called before answering (it may block).
	hold func(conv string, turn int)
}

type recorded struct {
	payload map[string]any
	keys    []string // the payload's top-level keys in wire order
	header  http.Header
	conv    string
	turn    int
}

func (f *fakeChat) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	raw, _ := io.ReadAll(r.Body)
	var p map[string]any
	if err := json.Unmarshal(raw, &p); err != nil {
		http.Error(w, err.Error(), 400)
		return
	}
	var keys []string
	dec := json.NewDecoder(bytes.NewReader(raw))
	for depth := 0; ; {
		tok, err := dec.Token()
		if err != nil {
			break
		}
		switch tok {
		case json.Delim('{'), json.Delim('['):
			depth++
		case json.Delim('}'), json.Delim(']'):
			depth--
		default:
			if k, ok := tok.(string); ok && depth == 1 && dec.More() {
				keys = append(keys, k)
				var skip json.RawMessage
				_ = dec.Decode(&skip)
			}
		}
	}
	msgs, _ := p["messages"].([]any)
	turn := (len(msgs) + 1) / 2
	first, _ := msgs[0].(map[string]any)
	conv := strings.Fields(first["content"].(string))[0]
	f.mu.Lock()
	f.requests = append(f.requests, recorded{payload: p, keys: keys, header: r.Header.Clone(), conv: conv, turn: turn})
	f.mu.Unlock()
	if f.hold != nil {
		f.hold(conv, turn)
	}
	if f.reject != nil && f.reject(conv, turn) {
		http.Error(w, `{"error": {"message": "scripted failure"}}`, 500)
		return
	}
	answer := fmt.Sprintf("answer %s %d", conv, turn)
	if p["stream"] != true {
		json.NewEncoder(w).Encode(map[string]any{"choices": []any{map[string]any{"message": map[string]any{"role": "assistant", "content": answer}}}})
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	words := strings.Fields(answer)
	chunks := []string{words[0] + " " + words[1], " " + words[2]}
	fmt.Fprintf(w, "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n")
	for _, c := range chunks {
		b, _ := json.Marshal(map[string]any{"choices": []any{map[string]any{"delta": map[string]any{"content": c}}}})
		fmt.Fprintf(w, "data: %s\n\n", b)
	}
	fmt.Fprintf(w, "data: [DONE]\n\n")
}

func (f *fakeChat) log() []recorded {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]recorded(nil), f.requests...)
}

// convs returns n conversations "cI" of the given user-turn counts; the first word of every
// first message is the id (the fake server keys on it), answers are "answer cI T".
func convs(turns ...int) []Conversation {
	var out []Conversation
	for i, n := range turns {
		id := fmt.Sprintf("c%d", i)
		c := Conversation{ID: id}
		for t := 1; t <= n; t++ {
			c.Messages = append(c.Messages, Message{"user", fmt.Sprintf("%s question %d", id, t)}, Message{"assistant", fmt.Sprintf("answer %s %d", id, t)})
		}
		out = append(out, c)
	}
	return out
}

func startFake(t *testing.T, f *fakeChat) string {
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	return srv.URL
}

func TestPayloadAndHeaders(t *testing.T) {
	f := &fakeChat{}
	url := startFake(t, f)
	tc := EstimateTokenCounter("test")
	res, err := Run(t.Context(), convs(2), Options{
		URL: url, Model: "served", Tokens: tc, SendConversationID: true, VerifyOutput: true,
		Header: http.Header{"X-Custom": {"v"}, "Authorization": {"Bearer k"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Samples) != 2 || res.Failures != 0 || len(res.Conversations) != 1 {
		t.Fatalf("samples %d failures %d finished %d", len(res.Samples), res.Failures, len(res.Conversations))
	}
	reqs := f.log()
	answerTokens := float64(tc.Count("answer c0 1"))
	for i, r := range reqs {
		p := r.payload
		if p["model"] != "served" || p["conversation_id"] != "c0" || p["stream"] != true {
			t.Errorf("payload %d: %v", i, p)
		}
		// The current vLLM script's payload, in its order: no seed, temperature or min_tokens.
		if want := []string{"model", "messages", "conversation_id", "stream", "stream_options", "max_tokens"}; strings.Join(r.keys, ",") != strings.Join(want, ",") {
			t.Errorf("payload %d keys %v, want %v", i, r.keys, want)
		}
		if so, _ := p["stream_options"].(map[string]any); so["include_usage"] != false {
			t.Errorf("stream_options %v", p["stream_options"])
		}
		if p["max_tokens"] != answerTokens {
			t.Errorf("max_tokens %v, want %v", p["max_tokens"], answerTokens)
		}
		if r.header.Get("X-Session-ID") != "c0" || r.header.Get("X-Custom") != "v" || r.header.Get("Authorization") != "Bearer k" || r.header.Get("Content-Type") != "application/json" {
			t.Errorf("headers %v", r.header)
		}
		msgs := p["messages"].([]any)
		if last := msgs[len(msgs)-1].(map[string]any); last["role"] != "user" {
			t.Errorf("last message %v", last)
		}
	}
	// Turn 2 carries the server's first answer.
	if msgs := reqs[1].payload["messages"].([]any); len(msgs) != 3 || msgs[1].(map[string]any)["content"] != "answer c0 1" {
		t.Errorf("turn 2 messages %v", msgs)
	}
	// Two content chunks: the first holds 2 of the answer's words; one chunk after it.
	if s := res.Samples[0]; s.OutputNumChunks != 1 || s.OutputNumFirstChunkTokens != tc.Count("answer c0") || s.InputNumTurns != 1 || s.ApproxCachedPercent != 0 {
		t.Errorf("sample %+v", s)
	}
	if s := res.Samples[1]; s.InputNumTurns != 3 || s.ApproxCachedPercent <= 0 {
		t.Errorf("sample %+v", s)
	}
}

func TestLimitsAndNoConversationID(t *testing.T) {
	f := &fakeChat{}
	url := startFake(t, f)
	seed, temp := int64(0), 0.0
	if _, err := Run(t.Context(), convs(1), Options{URL: url, Model: "m", LimitMinTokens: 3, LimitMaxTokens: 7, NoStream: true,
		SendMinTokens: true, RequestSeed: &seed, Temperature: &temp}); err != nil {
		t.Fatal(err)
	}
	if _, err := Run(t.Context(), convs(1), Options{URL: url, Model: "m", LimitMinTokens: -1, LimitMaxTokens: -1}); err != nil {
		t.Fatal(err)
	}
	reqs := f.log()
	if p := reqs[0].payload; p["min_tokens"] != 3.0 || p["max_tokens"] != 7.0 || p["stream"] != nil || p["conversation_id"] != nil ||
		p["seed"] != 0.0 || p["temperature"] != 0.0 || reqs[0].header.Get("X-Session-ID") != "" {
		t.Errorf("limited payload (seed, temperature and min_tokens asked for) %v", p)
	}
	if p := reqs[1].payload; p["min_tokens"] != nil || p["max_tokens"] != nil {
		t.Errorf("unlimited payload %v", p)
	}
}

func TestRoundRobinAndQueueExhaustion(t *testing.T) {
	f := &fakeChat{}
	url := startFake(t, f)
	// One client holding both conversations alternates between them; when one finishes and the
	// queue is empty, the client stops (the other conversation is left unfinished, as in vLLM).
	res, err := Run(t.Context(), convs(3, 3), Options{URL: url, Model: "m", MaxActiveConversations: 2})
	if err != nil {
		t.Fatal(err)
	}
	var order []string
	for _, r := range f.log() {
		order = append(order, fmt.Sprintf("%s/%d", r.conv, r.turn))
	}
	if got := strings.Join(order, " "); got != "c1/1 c0/1 c1/2 c0/2 c1/3" {
		t.Errorf("order %s", got)
	}
	if len(res.Conversations) != 1 || res.Conversations[0].ID != "c1" {
		t.Errorf("finished %v", res.Conversations)
	}
	// Random sampling still sends only valid turns, in order per conversation.
	f2 := &fakeChat{}
	url2 := startFake(t, f2)
	if _, err := Run(t.Context(), convs(3, 3), Options{URL: url2, Model: "m", MaxActiveConversations: 2, Sampling: Random, Seed: 5}); err != nil {
		t.Fatal(err)
	}
	next := map[string]int{"c0": 1, "c1": 1}
	for _, r := range f2.log() {
		if r.turn != next[r.conv] {
			t.Errorf("random: %s turn %d, want %d", r.conv, r.turn, next[r.conv])
		}
		next[r.conv]++
	}
}

func TestRejectedRequestDropsConversation(t *testing.T) {
	f := &fakeChat{reject: func(conv string, turn int) bool { return conv == "c1" && turn == 2 }}
	url := startFake(t, f)
	var progress strings.Builder
	res, err := Run(t.Context(), convs(3, 3, 3), Options{URL: url, Model: "m", Progress: &progress})
	if err != nil {
		t.Fatal(err)
	}
	// c1 fails at turn 2 and is dropped; the client goes on with c2.
	if res.Failures != 1 || len(res.Samples) != 3+1+3 || len(res.Conversations) != 2 {
		t.Errorf("failures %d samples %d finished %d", res.Failures, len(res.Samples), len(res.Conversations))
	}
	if !strings.Contains(progress.String(), "conversation c1, turn 2 (attempt 1 of 1): request rejected: HTTP 500") {
		t.Errorf("progress:\n%s", progress.String())
	}
}

func TestVerifyOutputMismatchEndsClient(t *testing.T) {
	f := &fakeChat{}
	url := startFake(t, f)
	cs := convs(2, 2)
	cs[0].Messages[1].Content = "something else"
	var progress strings.Builder
	res, err := Run(t.Context(), cs, Options{URL: url, Model: "m", VerifyOutput: true, Progress: &progress})
	if err != nil {
		t.Fatal(err)
	}
	if res.Failures != 1 || len(res.Samples) != 0 || len(f.log()) != 1 || !strings.Contains(progress.String(), "do not match") {
		t.Errorf("failures %d samples %d requests %d\n%s", res.Failures, len(res.Samples), len(f.log()), progress.String())
	}
}

func TestMaxNumRequestsAndMaxTurns(t *testing.T) {
	f := &fakeChat{}
	url := startFake(t, f)
	res, err := Run(t.Context(), convs(5, 5), Options{URL: url, Model: "m", NumClients: 2, MaxNumRequests: 5, NoEarlyStop: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Samples) != 4 { // 5/2 = 2 per client
		t.Errorf("samples %d, want 4", len(res.Samples))
	}
	f2 := &fakeChat{}
	url2 := startFake(t, f2)
	res, err = Run(t.Context(), convs(5), Options{URL: url2, Model: "m", MaxTurns: 4})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Samples) != 2 || len(res.Conversations) != 1 {
		t.Errorf("max turns 4: samples %d finished %d", len(res.Samples), len(res.Conversations))
	}
}

func TestWarmupStep(t *testing.T) {
	f := &fakeChat{}
	url := startFake(t, f)
	res, err := Run(t.Context(), convs(3, 1, 3), Options{URL: url, Model: "m", NumClients: 1, WarmupStep: true})
	if err != nil {
		t.Fatal(err)
	}
	// Warm-up: turn 1 of all three; then c1 (one turn) is done and the measured run starts at
	// turn 2 of the others.
	var first3 []int
	for _, r := range f.log()[:3] {
		first3 = append(first3, r.turn)
	}
	if fmt.Sprint(first3) != "[1 1 1]" {
		t.Errorf("warm-up turns %v", first3)
	}
	if res.WarmupRuntime <= 0 || res.NumConversations != 3 {
		t.Errorf("warmup runtime %v, conversations %d", res.WarmupRuntime, res.NumConversations)
	}
	for _, s := range res.Samples {
		if s.Turn() < 2 {
			t.Errorf("warm-up sample measured: %+v", s)
		}
	}
	if len(res.Samples) == 0 {
		t.Error("no measured samples")
	}
}

// signalWriter closes ch the first time a write contains marker.
type signalWriter struct {
	mu     sync.Mutex
	marker string
	ch     chan struct{}
	done   bool
	b      strings.Builder
}

func (w *signalWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.b.Write(p)
	if !w.done && strings.Contains(w.b.String(), w.marker) {
		w.done = true
		close(w.ch)
	}
	return len(p), nil
}

func TestEarlyStop(t *testing.T) {
	sw := &signalWriter{marker: "early stop", ch: make(chan struct{})}
	c1Turn2 := make(chan struct{})
	f := &fakeChat{hold: func(conv string, turn int) {
		switch {
		case conv == "c0":
			<-c1Turn2 // c0's only request completes once c1's second turn is in flight
		case conv == "c1" && turn == 2:
			close(c1Turn2)
			<-sw.ch // hold c1's second turn until the early stop was announced
		}
	}}
	url := startFake(t, f)
	res, err := Run(t.Context(), convs(1, 5), Options{URL: url, Model: "m", NumClients: 2, Progress: sw})
	if err != nil {
		t.Fatal(err)
	}
	// The client of c0 finishes after one request; the other stops after its current request.
	if len(res.Samples) != 3 || len(res.Conversations) != 1 || res.Conversations[0].ID != "c0" {
		t.Errorf("samples %d, finished %v", len(res.Samples), res.Conversations)
	}
}

func TestOptionErrors(t *testing.T) {
	cs := convs(1, 1)
	for _, o := range []Options{
		{URL: "http://x", NumClients: 3},
		{URL: "http://x", NumClients: -1},
		{URL: "http://x", MaxActiveConversations: 3},
		{URL: "http://x", NumClients: 2, MaxActiveConversations: 1},
		{URL: "http://x", NumClients: 2, MaxNumRequests: 1},
		{URL: "http://x", LimitMinTokens: 5},
		{URL: "http://x", LimitMinTokens: 5, LimitMaxTokens: 4},
		{URL: "http://x", Sampling: "sideways"},
		{URL: "http://x", RequestTimeout: -1},
		{},
	} {
		if _, err := Run(t.Context(), cs, o); err == nil {
			t.Errorf("%+v: no error", o)
		}
	}
}
