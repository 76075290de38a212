package proxy

import (
	"context"
	"encoding/binary"
	"errors"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"
)

// vllmBatch encodes an EventBatch as vLLM's msgspec does (written from vllm/distributed/
// kv_events.py, not from kvbridge's encoder): array_like [ts, events, data_parallel_rank], each
// event a map tagged "type" with the fields in declaration order, defaults omitted.
func vllmBatch(t testing.TB, rank any, events ...map[string]any) []byte {
	t.Helper()
	evs := make([]any, len(events))
	for i, e := range events {
		evs[i] = e
	}
	b, err := msgpack.Marshal([]any{1.7e9, evs, rank})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func stored(hashes []any, bs int) map[string]any {
	return map[string]any{"type": kvBlockStored, "block_hashes": hashes, "parent_block_hash": nil,
		"token_ids": make([]int, bs*len(hashes)), "block_size": bs, "lora_id": nil, "medium": "GPU", "lora_name": nil}
}

// TestDecodeKVBatch decodes vLLM's layouts: tagged maps, the older array-like events, integer
// and bytes hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), a missing rank, unknown fields.
func TestDecodeKVBatch(t *testing.T) {
	big := uint64(0xfedcba9876543210)
	raw := []byte{0xaa, 0xbb, 0xfe, 0xdc, 0xba, 0x98, 0x76, 0x54, 0x32, 0x10}
	payload := vllmBatch(t, 2,
		stored([]any{uint64(1), big, raw}, 16),
		map[string]any{"type": kvBlockRemoved, "block_hashes": []any{uint64(1)}, "medium": "GPU", "future": []any{1, 2}},
		map[string]any{"type": kvAllBlocksCleared},
		map[string]any{"type": "SomethingNew", "x": 1})
	b, err := decodeKVBatch(payload)
	if err != nil {
		t.Fatal(err)
	}
	if b.rank != 2 || len(b.events) != 4 {
		t.Fatalf("rank %d, %d events", b.rank, len(b.events))
	}
	if e := b.events[0]; e.kind != kvBlockStored || e.blockSize != 16 || !slices.Equal(e.hashes, []uint64{1, big, big}) {
		t.Errorf("BlockStored decoded as %+v", e)
	}
	if e := b.events[1]; e.kind != kvBlockRemoved || !slices.Equal(e.hashes, []uint64{1}) {
		t.Errorf("BlockRemoved decoded as %+v", e)
	}
	if b.events[2].kind != kvAllBlocksCleared || b.events[3].kind != "SomethingNew" {
		t.Errorf("kinds %q, %q", b.events[2].kind, b.events[3].kind)
	}
	// The array-like layout of older vLLM releases, and a batch without its rank.
	old, _ := msgpack.Marshal([]any{1.0, []any{
		[]any{kvBlockStored, []any{7, 8}, nil, []int{1, 2}, 1, nil},
		[]any{kvBlockRemoved, []any{7}},
		[]any{kvAllBlocksCleared},
	}})
	if b, err = decodeKVBatch(old); err != nil {
		t.Fatal(err)
	}
	if b.rank != -1 || len(b.events) != 3 || b.events[0].blockSize != 1 || !slices.Equal(b.events[0].hashes, []uint64{7, 8}) || b.events[1].kind != kvBlockRemoved {
		t.Errorf("array-like batch decoded as %+v", b)
	}
}

// TestDecodeKVBatchRefuses: what is not vLLM's batch is an error, never a panic or a large
// allocation.
func TestDecodeKVBatchRefuses(t *testing.T) {
	good := vllmBatch(t, 0, stored([]any{1, 2}, 16))
	cases := map[string][]byte{
		"empty":              nil,
		"truncated":          good[:len(good)-3],
		"trailing bytes":     append(slices.Clone(good), 0xc0),
		"not an array":       {0xc3},
		"one field":          mustPack(t, []any{1.0}),
		"ts a string":        mustPack(t, []any{"now", []any{}}),
		"events a map":       mustPack(t, []any{1.0, map[string]any{}}),
		"event without type": mustPack(t, []any{1.0, []any{map[string]any{"block_hashes": []any{1}}}}),
		"hash a string":      mustPack(t, []any{1.0, []any{map[string]any{"type": kvBlockRemoved, "block_hashes": []any{"x"}}}}),
		"block size 0":       mustPack(t, []any{1.0, []any{stored([]any{1}, 0)}}),
		"rank negative":      mustPack(t, []any{1.0, []any{}, -1}),
		"array32 of 4G":      {0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff},
		"deep nesting":       {0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x91, 0x91, 0x91, 0x91, 0x91, 0x91, 0x91, 0xc0},
	}
	for name, p := range cases {
		if _, err := decodeKVBatch(p); !errors.Is(err, errKVEvent) {
			t.Errorf("%s: err %v, want errKVEvent", name, err)
		}
	}
}

func mustPack(t testing.TB, v any) []byte {
	t.Helper()
	b, err := msgpack.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// FuzzDecodeKVBatch: any payload decodes or fails, without a panic.
func FuzzDecodeKVBatch(f *testing.F) {
	f.Add(vllmBatch(f, 0, stored([]any{1, 2}, 16), map[string]any{"type": kvBlockRemoved, "block_hashes": []any{1}}))
	f.Add(mustPack(f, []any{1.0, []any{[]any{kvBlockStored, []any{7}, nil, []int{1}, 1}}}))
	f.Fuzz(func(t *testing.T, p []byte) {
		b, err := decodeKVBatch(p)
		if err == nil && len(b.events) > len(p) {
			t.Fatalf("%d events from %d bytes", len(b.events), len(p))
		}
	})
}

// TestKVSeq: the sequence state machine asks for a replay of what was missed (before the first
// batch seen, or in a gap) and for a reset when the sequence goes back (a new incarnation).
func TestKVSeq(t *testing.T) {
	var s kvSeq
	steps := []struct {
		seq  uint64
		want kvSeqAction
	}{
		{0, kvSeqAction{}},
		{1, kvSeqAction{}},
		{4, kvSeqAction{gap: true, from: 2}},
		{5, kvSeqAction{}},
		{0, kvSeqAction{reset: true}},            // restarted, seen from its first batch
		{1, kvSeqAction{}},                       //
		{0, kvSeqAction{reset: true}},            // restarted again
		{3, kvSeqAction{gap: true, from: 1}},     //
		{2, kvSeqAction{reset: true, gap: true}}, // back, not to 0: restarted, batches 0–1 missed
	}
	for i, st := range steps {
		if got := s.observe(st.seq); got != st.want {
			t.Errorf("step %d (seq %d): %+v, want %+v", i, st.seq, got, st.want)
		}
	}
	var late kvSeq
	if got := late.observe(7); got != (kvSeqAction{gap: true, from: 0}) {
		t.Errorf("joining at seq 7: %+v, want a replay from 0", got)
	}
	// Batches 0–4 replayed on connecting: the same arriving live are duplicates, the next is
	// not; a restart's low sequence after the window is one.
	var r kvSeq
	r.replayed(0, 5)
	for seq, want := range []kvSeqAction{{dup: true}, {dup: true}, {dup: true}, {dup: true}, {dup: true}, {}} {
		if got := r.observe(uint64(seq)); got != want {
			t.Errorf("after a replay of 0–4, seq %d: %+v, want %+v", seq, got, want)
		}
	}
	if got := r.observe(3); got != (kvSeqAction{reset: true, gap: true}) {
		t.Errorf("seq 3 after 5: %+v, want a new incarnation", got)
	}
	// Catch-ups before the first live batch replay successive ranges: the window covers them all.
	var c kvSeq
	c.replayed(0, 2)
	c.replayed(2, 2) // nothing new
	c.replayed(2, 4)
	for seq, want := range []kvSeqAction{{dup: true}, {dup: true}, {dup: true}, {dup: true}, {}} {
		if got := c.observe(uint64(seq)); got != want {
			t.Errorf("after catch-ups of 0–1 and 2–3, seq %d: %+v, want %+v", seq, got, want)
		}
	}
	var again kvSeq
	again.replayed(10, 10) // nothing replayed: no window
	if got := again.observe(10); got != (kvSeqAction{gap: true}) {
		t.Errorf("nothing replayed, then seq 10: %+v", got)
	}
}

// TestKVSubscriberGapAndRestart runs a subscriber against a PUB socket of the test's that
// publishes vLLM's frames: a gap without a replay endpoint marks the source stale, and a
// publisher that comes back on the same port with its sequence from 0 (a new incarnation) resets
// the source, so that the index holds what the new one stored, not what the old one did.
func TestKVSubscriberGapAndRestart(t *testing.T) {
	pub := zmq4.NewPub(t.Context())
	if err := pub.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	ep := "tcp://" + pub.Addr().String()
	ix := newKVIndex([]int{0}, 1, 1000)
	sub := &kvSubscriber{cfg: kvSourceConfig{endpoint: ep}, ix: ix, log: slog.New(slog.DiscardHandler)}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); sub.run(ctx) }()
	defer func() { cancel(); <-done }()

	send := func(p zmq4.Socket, seq uint64, hashes ...any) {
		t.Helper()
		msg := zmq4.NewMsgFrom([]byte(""), binary.BigEndian.AppendUint64(nil, seq), vllmBatch(t, 0, stored(hashes, 16)))
		if err := p.SendMulti(msg); err != nil {
			t.Fatal(err)
		}
	}
	// until publishes (the subscription may not have reached the PUB socket yet, and a PUB
	// drops what no subscriber asked for) until cond holds, under a deadline.
	until := func(what string, cond func() bool, publish func()) {
		t.Helper()
		deadline := time.After(30 * time.Second)
		tick := time.NewTicker(2 * time.Millisecond) // the publishing pace, not a wait for a result
		defer tick.Stop()
		for !cond() {
			publish()
			select {
			case <-deadline:
				t.Fatalf("%s: not within 30 s (index %d blocks, %d batches, stale %v)", what, ix.len(0), sub.batches.Load(), ix.isStale(0))
			case <-tick.C:
			}
		}
	}
	var seq uint64
	until("first batch", func() bool { return sub.batches.Load() > 0 }, func() { send(pub, seq, seq+100); seq++ })
	gaps := sub.gaps.Load()
	send(pub, seq+4, 3) // batches seq…seq+3 lost, and no replay endpoint
	until("the gap", func() bool { return sub.gaps.Load() > gaps && ix.longestPrefix([]uint64{3})[0].blocks == 1 }, func() {})
	if !ix.isStale(0) {
		t.Fatal("not stale after a gap without a replay endpoint")
	}
	// The publisher restarts on the same port.
	if err := pub.Close(); err != nil {
		t.Fatal(err)
	}
	pub2 := zmq4.NewPub(t.Context())
	defer pub2.Close()
	if err := pub2.Listen(ep); err != nil {
		t.Fatal(err)
	}
	// The new incarnation counts from 0 again; the subscriber may miss its first batches (it
	// dials again after a backoff), and any of them tells it the engine restarted.
	until("the new incarnation", func() bool { return sub.resets.Load() > 0 && ix.longestPrefix([]uint64{1000})[0].blocks == 1 },
		func() { send(pub2, 0, 1000) })
	if got := ix.longestPrefix([]uint64{3}); got[0].blocks != 0 {
		t.Fatalf("after the restart the index still holds the old incarnation's block: %+v", got)
	}
}

// TestKVSubscriberCatchesUp: a batch the engine published while the subscription had not yet
// taken effect at its PUB socket (so it never arrives live) reaches the index from the replay
// socket, although no later batch shows the gap. The PUB socket here never sends; the replay
// socket is the test's ROUTER, answering as an engine's does ([empty, seq, payload] per batch
// kept from the one asked for, then seq -1).
func TestKVSubscriberCatchesUp(t *testing.T) {
	pub := zmq4.NewPub(t.Context())
	defer pub.Close()
	rep := zmq4.NewRouter(t.Context())
	defer rep.Close()
	for _, s := range []zmq4.Socket{pub, rep} {
		if err := s.Listen("tcp://127.0.0.1:0"); err != nil {
			t.Fatal(err)
		}
	}
	var mu sync.Mutex
	var kept [][]byte // the engine's replay buffer, batch i at i
	asked := make(chan uint64, 1)
	quit, served := make(chan struct{}), make(chan struct{})
	go func() { // ends when the ROUTER closes or quit
		defer close(served)
		for {
			msg, err := rep.Recv()
			if err != nil {
				return
			}
			f := msg.Frames // [identity, empty, from]
			if len(f) != 3 || len(f[2]) != 8 {
				t.Errorf("a replay request of %d frames", len(f))
				return
			}
			from := binary.BigEndian.Uint64(f[2])
			mu.Lock()
			batches := slices.Clone(kept[min(from, uint64(len(kept))):])
			mu.Unlock()
			for i, b := range batches {
				_ = rep.Send(zmq4.NewMsgFrom(f[0], nil, binary.BigEndian.AppendUint64(nil, from+uint64(i)), b))
			}
			_ = rep.Send(zmq4.NewMsgFrom(f[0], nil, binary.BigEndian.AppendUint64(nil, ^uint64(0)), nil))
			select {
			case asked <- from:
			case <-quit:
				return
			}
		}
	}()
	defer func() { close(quit); rep.Close(); <-served }()

	ix := newKVIndex([]int{0}, 1, 1000)
	sub := &kvSubscriber{cfg: kvSourceConfig{endpoint: "tcp://" + pub.Addr().String(), replay: "tcp://" + rep.Addr().String()},
		ix: ix, log: slog.New(slog.DiscardHandler)}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); sub.run(ctx) }()
	defer func() { cancel(); <-done }()

	deadline := time.After(time.Minute)
	next := func(what string) uint64 {
		t.Helper()
		select {
		case from := <-asked:
			return from
		case <-deadline:
			t.Fatalf("%s: no replay request within a minute (index %d blocks)", what, ix.len(0))
			return 0
		}
	}
	if from := next("on connecting"); from != 0 {
		t.Fatalf("the first replay asked from %d, want 0", from)
	}
	// Published after that replay was answered, and dropped by the PUB socket.
	mu.Lock()
	kept = append(kept, vllmBatch(t, 0, stored([]any{7}, 16)))
	mu.Unlock()
	for next("catching up") != 1 { // asking from 1: batch 0 was applied
	}
	if got := ix.longestPrefix([]uint64{7}); got[0].blocks != 1 {
		t.Fatalf("caught up batch 0, yet the index holds %+v", got)
	}
	if sub.gaps.Load() != 0 || sub.replayed.Load() != 1 || ix.isStale(0) {
		t.Errorf("gaps %d, replays %d, stale %v; want 0, 1, false", sub.gaps.Load(), sub.replayed.Load(), ix.isStale(0))
	}
}

// TestOffsetEndpoint: rank r's endpoint, as vLLM's offset_endpoint_port, and the forms refused.
func TestOffsetEndpoint(t *testing.T) {
	for _, c := range []struct {
		ep   string
		r    int
		want string
	}{
		{"tcp://10.0.0.1:5557", 0, "tcp://10.0.0.1:5557"},
		{"tcp://10.0.0.1:5557", 3, "tcp://10.0.0.1:5560"},
		{"tcp://[::1]:5557", 1, "tcp://[::1]:5558"},
		{"ipc:///tmp/kv", 0, "ipc:///tmp/kv"},
		{"ipc:///tmp/kv", 2, "ipc:///tmp/kv_dp2"},
	} {
		if got, err := offsetEndpoint(c.ep, c.r); err != nil || got != c.want {
			t.Errorf("offsetEndpoint(%q, %d) = %q, %v; want %q", c.ep, c.r, got, err, c.want)
		}
	}
	for _, ep := range []string{"", "tcp://*:5557", "tcp://host", "tcp://host:0", "tcp://host:65535x", "inproc://x", "ipc://", "udp://h:1"} {
		if _, err := offsetEndpoint(ep, 1); err == nil {
			t.Errorf("offsetEndpoint(%q) accepted", ep)
		}
	}
	if _, err := offsetEndpoint("tcp://h:65535", 1); err == nil {
		t.Error("a port beyond 65535 accepted")
	}
}
