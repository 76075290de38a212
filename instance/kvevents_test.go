package instance

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/engine"
	"github.com/kvbridge/kvbridge/internal/fixture"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/kvevents"
	"github.com/kvbridge/kvbridge/model"
)

// TestKVEventsToIndependentSubscriber runs an engine with --kv-events-config whose PUB socket
// connects to a Python subscriber written from vLLM's schema, drives the prefix cache through
// stores, a prefix hit that extends a chain, eviction by a request that needs the whole pool,
// preemption and a reset of the prefix cache, and checks: every batch decodes by vLLM's schema with data_parallel_rank 0;
// the stores of known prompts carry vLLM's external hashes of their chains, their parents and
// tokens; the evicted blocks are removed; the reset is one AllBlocksCleared; a consumer that applies the whole stream (replayed
// from sequence 0 by an anonymous DEALER) knows exactly as many blocks as the pool caches; and
// the live batches are the replayed ones.
func TestKVEventsToIndependentSubscriber(t *testing.T) {
	vh := fixture.SeedBlockHashes(t)
	sub := fixture.StartKVSubscriber(t, "kvbridge")
	evCfg, err := kvevents.ParseConfig(fmt.Sprintf(`{"enable_kv_cache_events": true, "publisher": "zmq",
		"endpoint": "tcp://127.0.0.1:%d", "replay_endpoint": "tcp://127.0.0.1:0", "topic": "kvbridge"}`, sub.Port))
	if err != nil {
		t.Fatal(err)
	}
	const bs, blocks = 4, 64
	in, _, err := start(t, Config{NumBlocks: blocks, BlockSize: bs, PrefixCaching: true, KVEvents: &evCfg, DevMode: true})
	if err != nil {
		t.Fatal(err)
	}
	pub := in.Ranks[0].KVEvents
	hc := &http.Client{}
	defer hc.CloseIdleConnections()
	ids := func(from, n int) []int32 {
		out := make([]int32, n)
		for i := range out {
			out[i] = int32(from + i)
		}
		return out
	}
	run := func(prompt []int32, maxTokens int) {
		t.Helper()
		complete(t, hc, in, map[string]any{"model": model.Tiny, "prompt": prompt, "max_tokens": maxTokens, "ignore_eos": true, "temperature": 0})
	}

	// The subscription reaches the engine some time after it connects: warm up with one-block
	// prompts until a batch arrives (a poll with a deadline; the replay below gets what was
	// missed).
	var live []fixture.KVBatch
	deadline := time.Now().Add(time.Minute)
	for i := 0; len(live) == 0; i++ {
		if time.Now().After(deadline) {
			t.Fatal("no batch reached the subscriber")
		}
		run(ids(3000+8*i, 5), 1)
		if b, ok := sub.Live(100 * time.Millisecond); ok { // a poll interval
			live = append(live, b)
		}
	}

	a := ids(1000, 10) // two full blocks
	run(a, 1)
	a3 := append(slices.Clone(a[:8]), ids(2000, 8)...) // hits a's two blocks, stores two more
	run(a3, 1)
	b := ids(100, 240) // needs 61 of the 64 blocks: evicts cached ones
	run(b, 1)
	for try := 0; try < 5 && in.Engine.Stats().Preemptions == 0; try++ {
		complete(t, hc, in, map[string]any{"model": model.Tiny, "prompt": "Grow until the pool is short.", "max_tokens": 100,
			"ignore_eos": true, "n": 3, "temperature": 1, "seed": try})
	}
	if in.Engine.Stats().Preemptions == 0 {
		t.Fatal("no preemption: the pool is too large for this test")
	}

	// With every request finished, a reset drops the prefix cache: one AllBlocksCleared.
	hashesBefore := in.Pool.NumCached()
	// (POST /reset_prefix_cache, vLLM's dev-mode route: VLLM_SERVER_DEV_MODE=1.)
	if code := postStatus(t, hc, in.URL+"/reset_prefix_cache"); code != http.StatusOK || in.Pool.NumCached() != 0 {
		t.Fatalf("reset: HTTP %d, %d blocks cached (%d before)", code, in.Pool.NumCached(), hashesBefore)
	}

	// A last prompt's store, once it arrives live, follows every earlier event (batches are
	// sent in order, and the requests before it had finished). Then replay everything from 0.
	sentinel := ids(3900, 5)
	run(sentinel, 1)
	last := vh.First(sentinel[:bs]).External()
	var total uint64
	for total == 0 {
		b := sub.NextLive()
		live = append(live, b)
		for _, e := range b.Events {
			if e.Type == "BlockStored" && slices.Contains(e.BlockHashes, last) {
				total = b.Seq + 1
			}
		}
	}
	replayed, more := sub.Replay("tcp://"+pub.ReplayAddr().String(), 0)
	live = append(live, more...)
	if uint64(len(replayed)) < total {
		t.Fatalf("replayed %d batches, %d were sent", len(replayed), total)
	}
	for i, r := range replayed {
		if r.Seq != uint64(i) {
			t.Fatalf("replayed batch %d has sequence %d", i, r.Seq)
		}
		if r.Rank == nil || *r.Rank != 0 {
			t.Fatalf("batch %d: data_parallel_rank %v, want 0", i, r.Rank)
		}
	}
	// The live batches are the replayed ones, in order with no gap after the first.
	for i, l := range live {
		if i > 0 && l.Seq != live[i-1].Seq+1 {
			t.Fatalf("live sequence %d after %d", l.Seq, live[i-1].Seq)
		}
		if l.Seq >= uint64(len(replayed)) {
			continue
		}
		got, _ := json.Marshal(l)
		want, _ := json.Marshal(replayed[l.Seq])
		if string(got) != string(want) {
			t.Fatalf("live batch %d %s, replayed %s", l.Seq, got, want)
		}
	}

	// Apply the stream as a consumer would.
	cached, everStored := map[uint64]bool{}, map[uint64]bool{}
	cleared := 0
	var stores []fixture.KVEvent
	removed := map[uint64]bool{}
	for _, r := range replayed {
		for _, e := range r.Events {
			switch e.Type {
			case "BlockStored":
				if e.BlockSize != bs || len(e.TokenIDs) != bs*len(e.BlockHashes) || e.LoraID != nil || e.LoraName != nil ||
					e.Medium == nil || *e.Medium != "GPU" {
					t.Fatalf("seq %d: store %+v", r.Seq, e)
				}
				if !slices.Equal(e.VLLMHashes, e.BlockHashes) {
					t.Fatalf("seq %d: store of %v; vLLM's hashes of its tokens (computed by the subscriber) are %v", r.Seq, e.BlockHashes, e.VLLMHashes)
				}
				// The parent was stored before, though it may have left the cache since: a
				// request whose block duplicated a cached one's content (computed at the same
				// time) keeps its copy after the cached one is reused, and chains on from it.
				if e.Parent != nil && !everStored[*e.Parent] {
					t.Fatalf("seq %d: store under parent %#x, which was never stored", r.Seq, *e.Parent)
				}
				for _, h := range e.BlockHashes {
					if cached[h] {
						t.Fatalf("seq %d: %#x stored twice", r.Seq, h)
					}
					cached[h], everStored[h] = true, true
				}
				stores = append(stores, e)
			case "BlockRemoved":
				for _, h := range e.BlockHashes {
					if !cached[h] {
						t.Fatalf("seq %d: %#x removed but not stored", r.Seq, h)
					}
					delete(cached, h)
					removed[h] = true
				}
			case "AllBlocksCleared":
				clear(cached)
				cleared++
			default:
				t.Fatalf("seq %d: unexpected %s", r.Seq, e.Type)
			}
		}
	}
	if cleared != 1 {
		t.Errorf("%d AllBlocksCleared, want 1 (the reset)", cleared)
	}
	if len(cached) != in.Pool.NumCached() {
		t.Errorf("the consumer knows %d cached blocks, the pool caches %d", len(cached), in.Pool.NumCached())
	}
	ext := func(tokens []int32) []uint64 {
		var out []uint64
		for _, h := range vh.Chain(tokens, bs) {
			out = append(out, h.External())
		}
		return out
	}
	find := func(hashes []uint64) *fixture.KVEvent {
		for i := range stores {
			if slices.Equal(stores[i].BlockHashes, hashes) {
				return &stores[i]
			}
		}
		return nil
	}
	ha, ha3 := ext(a), ext(a3)
	if e := find(ha); e == nil || e.Parent != nil || !slices.Equal(e.TokenIDs, a[:8]) {
		t.Errorf("store of a's two blocks from the root: %+v", e)
	}
	if e := find(ha3[2:4]); e == nil || e.Parent == nil || *e.Parent != ha[1] || !slices.Equal(e.TokenIDs, a3[8:16]) {
		t.Errorf("store of a3's two new blocks under a's second: %+v", e)
	}
	if e := find(ext(b)); e == nil || !slices.Equal(e.TokenIDs, b) {
		t.Errorf("store of b's 60 blocks: %+v", e)
	}
	if !removed[ha[0]] && !removed[ha[1]] && !removed[ha3[2]] && !removed[ha3[3]] {
		t.Error("b needed the whole pool, yet no block of a or a3 was removed")
	}
	if d := pub.Dropped(); d != 0 {
		t.Errorf("%d batches dropped", d)
	}
}

// TestKVEventsPerDataParallelRank: with two ranks, rank 1 publishes on the endpoints with vLLM's
// rank offset (ipc paths get "_dp1") and stamps its batches data_parallel_rank 1, as the
// independent subscriber decodes them from rank 1's replay socket.
func TestKVEventsPerDataParallelRank(t *testing.T) {
	vh := fixture.SeedBlockHashes(t)
	sub := fixture.StartKVSubscriber(t, "")
	dir := t.TempDir()
	evCfg, err := kvevents.ParseConfig(fmt.Sprintf(`{"enable_kv_cache_events": true, "endpoint": "ipc://%s/pub", "replay_endpoint": "ipc://%s/replay"}`, dir, dir))
	if err != nil {
		t.Fatal(err)
	}
	in, _, err := start(t, Config{NumBlocks: 32, PrefixCaching: true, DataParallelSize: 2, KVEvents: &evCfg})
	if err != nil {
		t.Fatal(err)
	}
	if code := postStatus(t, http.DefaultClient, in.URL+"/reset_prefix_cache"); code != http.StatusNotFound {
		t.Errorf("POST /reset_prefix_cache outside dev mode: HTTP %d, want 404", code)
	}
	for _, rk := range in.Ranks {
		suffix := ""
		if rk.Index > 0 {
			suffix = fmt.Sprintf("_dp%d", rk.Index)
		}
		if got, want := rk.KVEvents.Addr().String(), dir+"/pub"+suffix; got != want {
			t.Errorf("rank %d publishes on %s, want %s", rk.Index, got, want)
		}
		if got, want := rk.KVEvents.ReplayAddr().String(), dir+"/replay"+suffix; got != want {
			t.Errorf("rank %d replays on %s, want %s", rk.Index, got, want)
		}
		// One full block computed on this rank's engine.
		prompt := make([]int32, 20)
		for i := range prompt {
			prompt[i] = int32(100*rk.Index + i + 1)
		}
		st, err := rk.Engine.Add(t.Context(), &engine.Request{Prompt: prompt, MaxTokens: 1})
		if err != nil {
			t.Fatal(err)
		}
		for range st.C() {
		}
		// The step's events are published after its output: replay until they are there.
		want := vh.First(prompt[:kvcache.DefaultBlockSize]).External()
		deadline := time.Now().Add(time.Minute)
		for found := false; !found; {
			if time.Now().After(deadline) {
				t.Fatalf("rank %d: its store never reached the replay socket", rk.Index)
			}
			batches, _ := sub.Replay("ipc://"+dir+"/replay"+suffix, 0)
			for _, b := range batches {
				if b.Rank == nil || *b.Rank != rk.Index {
					t.Fatalf("rank %d published a batch of data_parallel_rank %v", rk.Index, b.Rank)
				}
				for _, e := range b.Events {
					found = found || slices.Contains(e.BlockHashes, want)
				}
			}
		}
	}
}

// postStatus POSTs an empty body to url and returns the status code.
func postStatus(t *testing.T, hc *http.Client, url string) int {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode
}
