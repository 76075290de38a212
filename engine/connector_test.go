package engine

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/model"
)

// The connectors below are stand-ins for package connector (issue 4), which does not exist yet:
// they exercise the engine's side of the Connector contract end to end — a producer engine holds
// its KV after finishing (delayed free), a consumer engine parks a request while the test copies
// that KV into its blocks (the "transfer"), then LoadsDone resumes it — without any networking.

// holdConnector is a producer: finished do_remote_decode requests keep their blocks for a
// remote reader.
type holdConnector struct {
	NoConnector
	held chan heldKV
}

type heldKV struct {
	id          string
	blocks      []int32
	numComputed int
	first       FirstToken // the producer's first token and its sampler's draws
}

func (c *holdConnector) Finished(q *Sequence, st Status, _ time.Time) (bool, map[string]any) {
	if q.KVTransfer()["do_remote_decode"] != true || (st != StatusFinishedLengthCapped && st != StatusFinishedStopped) {
		return false, nil
	}
	c.held <- heldKV{id: q.ID(), blocks: slices.Clone(q.Blocks()), numComputed: q.NumComputed(),
		first: FirstToken{Token: q.Output()[0], Draws: q.FirstTokenDraws()}}
	return true, map[string]any{"do_remote_prefill": true, "remote_request_id": q.ID(), "remote_num_tokens": q.NumComputed()}
}

// loadConnector is a consumer: requests with remote params load their prompt's KV asynchronously.
type loadConnector struct {
	NoConnector
	allocs chan loadAlloc
	loaded map[string]bool // step loop only
}

type loadAlloc struct {
	id                 string
	blocks             []int32
	localHit, external int
}

func (c *loadConnector) MatchedExternal(q *Sequence, localHit int) (int, bool) {
	if q.KVTransfer()["remote_request_id"] == nil || c.loaded[q.ID()] {
		return 0, false
	}
	return q.NumPromptTokens() - localHit, true
}

func (c *loadConnector) AfterAlloc(q *Sequence, blocks []int32, numExternal int) {
	if numExternal == 0 {
		return
	}
	c.loaded[q.ID()] = true
	c.allocs <- loadAlloc{id: q.ID(), blocks: slices.Clone(blocks), localHit: q.NumLocalHitTokens(), external: numExternal}
}

// copyKV copies the blocks holding positions [a.localHit, a.localHit+a.external) from the
// producer's pool into the consumer's (same geometry, so block i holds the same positions).
func copyKV(t *testing.T, dst, src *kvcache.Pool, a loadAlloc, srcBlocks []int32) {
	t.Helper()
	bs := dst.Geometry().BlockSize
	for i := a.localHit / bs; i < (a.localHit+a.external+bs-1)/bs; i++ {
		if err := dst.WriteBlock(a.blocks[i], src.Bytes(srcBlocks[i])); err != nil {
			t.Fatal(err)
		}
	}
}

func recv[T any](t *testing.T, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(waitTimeout):
		t.Fatal("timeout")
	}
	var zero T
	return zero
}

func TestEngineConnectorAsyncLoad(t *testing.T) {
	m := openTiny(t)
	const bs = 16
	prompt := testPrompts(m, 40)[0]
	want := oneAtATime(t, m, bs, []*Request{greedy("ref", prompt, 10)})[0]

	for _, tc := range []struct {
		name     string
		policy   FailurePolicy
		badBlock int // -1: the load succeeds
		cached   int
	}{
		{"ok", FailurePolicyFail, -1, 39}, // the last prompt token is computed locally
		{"fail", FailurePolicyFail, 1, 39},
		{"recompute", FailurePolicyRecompute, 1, 16},
		{"recompute from zero", FailurePolicyRecompute, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pc := &holdConnector{held: make(chan heldKV, 4)}
			pe, ppool := newTestEngine(t, m, 16, Config{BlockSize: bs, PrefixCaching: true, Connector: pc})
			dc := &loadConnector{allocs: make(chan loadAlloc, 4), loaded: map[string]bool{}}
			de, dpool := newTestEngine(t, m, 16, Config{BlockSize: bs, PrefixCaching: true, Connector: dc,
				KVLoadFailurePolicy: tc.policy})

			// Prefill on the producer: max_tokens 1, KV held after the finish.
			ps, err := pe.Add(t.Context(), &Request{ID: "p", Prompt: prompt, MaxTokens: 1,
				KVTransfer: map[string]any{"do_remote_decode": true}})
			if err != nil {
				t.Fatal(err)
			}
			pr := collect(t, ps)
			held := recv(t, pc.held)
			if pr.final.KVTransfer["remote_request_id"] != "p" || held.numComputed != len(prompt) || !slices.Equal(pr.tokens, want.tokens[:1]) {
				t.Fatalf("producer: %+v, held %+v", pr.final, held)
			}
			if st := pe.Stats(); st.Delayed != 1 || ppool.NumFree() != ppool.NumBlocks()-3 {
				t.Fatalf("producer holds %d requests, %d blocks free", st.Delayed, ppool.NumFree())
			}

			// Decode on the consumer: parks until the KV is copied.
			ds, err := de.Add(t.Context(), &Request{ID: "d", Prompt: prompt, MaxTokens: 10, KVTransfer: pr.final.KVTransfer})
			if err != nil {
				t.Fatal(err)
			}
			a := recv(t, dc.allocs)
			if a.localHit != 0 || a.external != 40 || len(a.blocks) != 3 {
				t.Fatalf("consumer alloc %+v", a)
			}
			copyKV(t, dpool, ppool, a, held.blocks)
			if tc.badBlock < 0 {
				de.LoadsDone([]string{"d"}, nil, nil)
			} else {
				de.LoadsDone(nil, nil, map[string]int{"d": tc.badBlock})
			}
			pe.ReleaseDelayed("p") // the "notification": the producer frees
			got := collect(t, ds)
			if tc.name == "fail" {
				if got.final.FinishReason != "error" || !errors.Is(got.final.Err, ErrKVLoad) || len(got.tokens) != 0 {
					t.Fatalf("fail policy: %+v", got.final)
				}
				if de.Stats().LoadFailures != 1 {
					t.Fatalf("stats %+v", de.Stats())
				}
				return
			}
			if !slices.Equal(got.tokens, want.tokens) || got.text != want.text {
				t.Fatalf("consumer output %v, want %v", got.tokens, want.tokens)
			}
			if got.final.CachedTokens != tc.cached {
				t.Fatalf("cached tokens %d, want %d", got.final.CachedTokens, tc.cached)
			}
		})
	}
}

func TestEngineAbortWhileWaitingForRemoteKV(t *testing.T) {
	m := openTiny(t)
	dc := &loadConnector{allocs: make(chan loadAlloc, 4), loaded: map[string]bool{}}
	de, dpool := newTestEngine(t, m, 16, Config{BlockSize: 16, Connector: dc})
	ctx, cancel := context.WithCancel(t.Context())
	s, err := de.Add(ctx, &Request{ID: "d", Prompt: testPrompts(m, 30)[0], MaxTokens: 4,
		KVTransfer: map[string]any{"remote_request_id": "p"}})
	if err != nil {
		t.Fatal(err)
	}
	recv(t, dc.allocs)
	// The hook ran inside Schedule; the loop publishes its stats right after.
	deadline := time.Now().Add(waitTimeout)
	for de.Stats().WaitingForRemote != 1 && time.Now().Before(deadline) {
		runtime.Gosched()
	}
	if st := de.Stats(); st.WaitingForRemote != 1 || dpool.NumFree() != dpool.NumBlocks()-2 {
		t.Fatalf("stats %+v", st)
	}
	cancel()
	if r := collect(t, s); r.final.FinishReason != "abort" {
		t.Fatalf("final %+v", r.final)
	}
	assertPoolFull(t, dpool)
	de.LoadsDone([]string{"d"}, nil, nil) // a late completion for an aborted request is ignored
}

func TestEngineCloseReleasesHeldBlocks(t *testing.T) {
	m := openTiny(t)
	pc := &holdConnector{held: make(chan heldKV, 8)}
	pe, ppool := newTestEngine(t, m, 16, Config{BlockSize: 16, Connector: pc})
	for i := range 3 {
		s, err := pe.Add(t.Context(), &Request{ID: fmt.Sprint(i), Prompt: testPrompts(m, 20)[0], MaxTokens: 1,
			KVTransfer: map[string]any{"do_remote_decode": true}})
		if err != nil {
			t.Fatal(err)
		}
		collect(t, s)
	}
	if ppool.NumFree() == ppool.NumBlocks() {
		t.Fatal("nothing held")
	}
	pe.Close()
	assertPoolFull(t, ppool)
}

// TestEngineConnectorFirstToken: a consumer whose load brings the whole prompt's KV with the
// producer's first token runs no step before its first decode step, reports the whole prompt as
// cached, and its output is a single engine's — greedy, and seeded sampling with penalties (its
// sampler skips the producer's draw) — streamed from that first token; with max_tokens 1 the
// token is the whole answer and the blocks are freed at once.
func TestEngineConnectorFirstToken(t *testing.T) {
	m := openTiny(t)
	const bs = 16
	prompt := testPrompts(m, 40)[0]
	seeded := &Request{Prompt: prompt, MaxTokens: 10, Sampling: model.SamplingParams{Temperature: 1, Seed: 7, TopK: 50, PresencePenalty: 0.5}}
	for _, tc := range []struct {
		name  string
		req   *Request
		draws int
	}{
		{"greedy", greedy("", prompt, 10), 0},
		{"seeded", seeded, 1},
		{"one token", &Request{Prompt: prompt, MaxTokens: 1, Sampling: seeded.Sampling}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ref := *tc.req
			ref.ID = "ref"
			want := oneAtATime(t, m, bs, []*Request{&ref})[0]
			pc := &holdConnector{held: make(chan heldKV, 4)}
			pe, ppool := newTestEngine(t, m, 16, Config{BlockSize: bs, Connector: pc})
			dc := &loadConnector{allocs: make(chan loadAlloc, 4), loaded: map[string]bool{}}
			de, dpool := newTestEngine(t, m, 16, Config{BlockSize: bs, Connector: dc})

			preq := *tc.req
			preq.ID, preq.MaxTokens, preq.KVTransfer = "p", 1, map[string]any{"do_remote_decode": true}
			ps, err := pe.Add(t.Context(), &preq)
			if err != nil {
				t.Fatal(err)
			}
			pr := collect(t, ps)
			held := recv(t, pc.held)
			if held.first.Token != want.tokens[0] || held.first.Draws != tc.draws {
				t.Fatalf("producer sampled %+v, want token %d with %d draws", held.first, want.tokens[0], tc.draws)
			}
			dreq := *tc.req
			dreq.ID, dreq.KVTransfer = "d", pr.final.KVTransfer
			ds, err := de.Add(t.Context(), &dreq)
			if err != nil {
				t.Fatal(err)
			}
			a := recv(t, dc.allocs)
			copyKV(t, dpool, ppool, a, held.blocks)
			de.LoadsDone([]string{"d"}, map[string]FirstToken{"d": held.first}, nil)
			pe.ReleaseDelayed("p")
			got := collect(t, ds)
			if !slices.Equal(got.tokens, want.tokens) || got.text != want.text || got.final.FinishReason != want.final.FinishReason {
				t.Fatalf("consumer output %v %q (%s), want %v %q (%s)", got.tokens, got.text, got.final.FinishReason, want.tokens, want.text, want.final.FinishReason)
			}
			if got.final.CachedTokens != len(prompt) || got.final.ExternalCachedTokens != len(prompt) {
				t.Errorf("cached %d (external %d), want the whole prompt (%d)", got.final.CachedTokens, got.final.ExternalCachedTokens, len(prompt))
			}
			// One decode step per token after the first, none before it.
			if steps := de.Stats().Steps; steps != int64(len(want.tokens)-1) {
				t.Errorf("the consumer ran %d steps for %d tokens, want %d", steps, len(want.tokens), len(want.tokens)-1)
			}
			assertPoolFull(t, dpool)
			// The producer frees on its loop once it applied the release.
			for deadline := time.Now().Add(waitTimeout); pe.Stats().Delayed != 0 && time.Now().Before(deadline); {
				runtime.Gosched()
			}
			assertPoolFull(t, ppool)
		})
	}
}
