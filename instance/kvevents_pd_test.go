package instance_test

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/apiclient"
	"github.com/kvbridge/kvbridge/internal/fixture"
	"github.com/kvbridge/kvbridge/kvevents"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/stack"
)

// TestKVEventsAcrossPD runs P and D in bidirectional mode behind the multi-turn proxy, both
// publishing KV cache events to one Python subscriber written from vLLM's schema, and reads each
// engine's whole stream from its replay socket. Turn 1: P's prefill stores its prompt blocks
// and D, pulling them, stores the same hashes (the engines hash a prefix alike, which is what lets
// a router match them). A long prompt then evicts turn 1 from P's small pool (removals). Turn 2:
// P pulls the history D held for the conversation (D→P) and stores again blocks it had lost,
// which D had stored. Each engine's stream, applied in order, leaves exactly as many blocks as
// its pool caches.
func TestKVEventsAcrossPD(t *testing.T) {
	vh := fixture.SeedBlockHashes(t)
	sub := fixture.StartKVSubscriber(t, "")
	m, err := stack.OpenModel(t.Context(), model.Tiny, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	events := func() *kvevents.Config {
		c, err := kvevents.ParseConfig(fmt.Sprintf(`{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:%d", "replay_endpoint": "tcp://127.0.0.1:0"}`, sub.Port))
		if err != nil {
			t.Fatal(err)
		}
		return &c
	}
	s, err := stack.Start(t.Context(), stack.Config{
		Model: m, Mode: stack.Bidirectional, NumBlocks: 256, MaxModelLen: 1024, BlockSize: 16,
		// P's pool is one request long: a long prompt between the turns evicts the first turn
		// from its prefix cache, so that turn 2 pulls it back from D.
		P: stack.EngineConfig{PrefixCaching: true, KVEvents: events(), NumBlocks: 64},
		D: stack.EngineConfig{PrefixCaching: true, KVEvents: events()},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := s.Close(); err != nil {
			t.Error(err)
		}
		if err := s.CheckPools(); err != nil {
			t.Error(err)
		}
	}()
	hc := &http.Client{Transport: stack.NewTransport(4)}
	defer hc.CloseIdleConnections()
	post := func(url, path string, body map[string]any) apiclient.Reply {
		t.Helper()
		r, err := apiclient.Post(t.Context(), hc, url+path, body, nil)
		if err == nil {
			err = r.Check(url)
		}
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	// stream replays e's whole stream once a sentinel prompt sent to it directly shows in it: the
	// requests before it have finished, so every earlier event precedes the sentinel's store.
	sentinels := 0
	stream := func(e *stack.Engine) []fixture.KVBatch {
		t.Helper()
		sentinels++
		prompt := make([]int32, 20)
		for i := range prompt {
			prompt[i] = int32(3000 + 40*sentinels + i)
		}
		post(e.URL(), "/v1/completions", map[string]any{"model": model.Tiny, "prompt": prompt, "max_tokens": 1})
		want := vh.First(prompt[:16]).External()
		ep := "tcp://" + e.Instance().Ranks[0].KVEvents.ReplayAddr().String()
		deadline := time.Now().Add(time.Minute)
		for {
			batches, _ := sub.Replay(ep, 0)
			for _, b := range batches {
				for _, ev := range b.Events {
					if ev.Type == "BlockStored" && slices.Contains(ev.BlockHashes, want) {
						return batches
					}
				}
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: the sentinel's store never came", e.Name)
			}
		}
	}
	// apply returns the hashes a consumer holds after the stream and all it ever saw stored.
	apply := func(name string, batches []fixture.KVBatch) (cached, stored map[uint64]bool) {
		t.Helper()
		cached, stored = map[uint64]bool{}, map[uint64]bool{}
		for i, b := range batches {
			if b.Seq != uint64(i) || b.Rank == nil || *b.Rank != 0 {
				t.Fatalf("%s: batch %d has sequence %d, rank %v", name, i, b.Seq, b.Rank)
			}
			for _, e := range b.Events {
				if e.Type == "BlockStored" && !slices.Equal(e.VLLMHashes, e.BlockHashes) {
					t.Fatalf("%s: batch %d stores %v; vLLM's hashes of its tokens (computed by the subscriber) are %v", name, i, e.BlockHashes, e.VLLMHashes)
				}
				for _, h := range e.BlockHashes {
					switch e.Type {
					case "BlockStored":
						if cached[h] {
							t.Fatalf("%s: %#x stored twice", name, h)
						}
						cached[h], stored[h] = true, true
					case "BlockRemoved":
						if !cached[h] {
							t.Fatalf("%s: %#x removed, not stored", name, h)
						}
						delete(cached, h)
					}
				}
			}
		}
		return cached, stored
	}

	msgs := []map[string]string{{"role": "user", "content": "Turn one: " + strings.Repeat("a router follows which engine caches which prefix. ", 6)}}
	body := map[string]any{"model": model.Tiny, "messages": msgs, "max_tokens": 120, "ignore_eos": true, "temperature": 0, "conversation_id": "events"}
	r1 := post(s.URL, "/v1/chat/completions", body)
	pTurn1 := stream(s.P)
	_, p1 := apply("P", pTurn1)
	_, d1 := apply("D", stream(s.D))
	shared := 0
	for h := range p1 {
		if d1[h] {
			shared++
		}
	}
	if shared < 5 { // the turn's prompt is over 5 blocks; the sentinels differ
		t.Errorf("turn 1: P and D stored %d hashes in common, want P's prompt blocks (%d stored by P, %d by D)", shared, len(p1), len(d1))
	}

	flush := make([]int32, 1000)
	for i := range flush {
		flush[i] = int32(2000 + i)
	}
	post(s.P.URL(), "/v1/completions", map[string]any{"model": model.Tiny, "prompt": flush, "max_tokens": 1})
	p0, err := s.P.Stats()
	if err != nil {
		t.Fatal(err)
	}
	msgs = append(msgs, map[string]string{"role": "assistant", "content": r1.Text},
		map[string]string{"role": "user", "content": "Turn two: " + strings.Repeat("and the history comes back from the decoder. ", 6)})
	body["messages"] = msgs
	post(s.URL, "/v1/chat/completions", body)
	pAfter, err := s.P.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if pAfter.PulledTokens == p0.PulledTokens {
		t.Fatal("turn 2: P pulled no history from D")
	}
	pAll := stream(s.P)
	pCached, _ := apply("P", pAll)
	dCached, d2 := apply("D", stream(s.D))
	// The blocks P stored in turn 2 that P had lost to the flush: pulled back from D, which
	// stored them first.
	removed := map[uint64]bool{}
	pulled := 0
	for _, b := range pAll {
		for _, e := range b.Events {
			for _, h := range e.BlockHashes {
				switch {
				case e.Type == "BlockRemoved":
					removed[h] = true
				case e.Type == "BlockStored" && b.Seq >= uint64(len(pTurn1)) && removed[h] && p1[h] && d2[h]:
					pulled++
				}
			}
		}
	}
	if pulled == 0 {
		t.Errorf("turn 2: P stored again none of the turn-1 blocks it had lost and D held (P pulled %d tokens)", pAfter.PulledTokens-p0.PulledTokens)
	}
	for _, c := range []struct {
		e      *stack.Engine
		cached map[uint64]bool
	}{{s.P, pCached}, {s.D, dCached}} {
		if n := c.e.Instance().Ranks[0].Pool.NumCached(); len(c.cached) != n {
			t.Errorf("%s: the consumer knows %d cached blocks, the pool caches %d", c.e.Name, len(c.cached), n)
		}
	}
}
