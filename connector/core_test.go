package connector

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/engine"
	"github.com/kvbridge/kvbridge/internal/fixture"
	"github.com/kvbridge/kvbridge/internal/kvlease"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/metrics"
	"github.com/kvbridge/kvbridge/transfer"
)

// The core's decisions, driven through the real scheduler on a fake clock: no model, no
// sockets, no goroutines. Each test reads the actions the core asks its worker to perform.

const coreBlockSize = 4

// t0 is when the tests' clocks start.
var t0 = time.Date(2026, 11, 29, 10, 0, 0, 0, time.UTC)

// countingReader is a deterministic token source: 0, 1, 2, … (tests only).
type countingReader struct{ n byte }

func (r *countingReader) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = r.n
		r.n++
	}
	return len(p), nil
}

// coreHarness is a core behind a real scheduler over a small pool.
type coreHarness struct {
	t       *testing.T
	k       *core
	sched   *engine.Scheduler
	pool    *kvcache.Pool
	records []byte // the pool's record table
	now     time.Time
	acts    actions
	reg     *metrics.Registry
	nixl    *metrics.NixlMetrics
}

// newCoreHarness builds a core for a --kv-transfer-config document.
func newCoreHarness(t *testing.T, kvConfig string) *coreHarness {
	t.Helper()
	cfg, err := ParseConfig([]byte(kvConfig), nil)
	if err != nil {
		t.Fatal(err)
	}
	geo := kvcache.Geometry{NumLayers: 1, NumKVHeads: 1, HeadDim: 4, BlockSize: coreBlockSize}
	const numBlocks = 32
	layout := NewArenaLayout(geo.BlockBytes(), numBlocks)
	records := kvcache.AlignedMemory(int(layout.RecordsBytes))
	pool, err := kvcache.NewPool(kvcache.AlignedMemory(numBlocks*geo.BlockBytes()), kvcache.PoolConfig{
		Geometry: geo, NumBlocks: numBlocks, RecordTable: records})
	if err != nil {
		t.Fatal(err)
	}
	peers, err := newPeerFilter(cfg.AllowedPeers)
	if err != nil {
		t.Fatal(err)
	}
	h := &coreHarness{t: t, pool: pool, records: records, now: t0, reg: metrics.NewRegistry()}
	h.nixl = h.reg.Engine("m", "0").Nixl()
	h.k = &core{
		cfg: cfg, pool: pool, geo: geo, layout: layout, slots: kvcache.AlignedMemory(int(layout.SlotsBytes)),
		log: testLogger(io.Discard), metrics: h.nixl, epoch: t0, engineID: "self", instance: "inst-self",
		host: "self-host", port: 5600, random: &countingReader{}, reqs: map[string]*reqState{},
		remotes: map[remoteKey]*remoteRecord{}, counts: &counters{}, peers: peers, push: newPushState(),
	}
	if cfg.AuthToken != "" {
		h.k.paramsKey = paramsMACKey(cfg.AuthToken)
	}
	h.k.heartbeats.Interval = max(cfg.LeaseDuration/6, time.Second)
	scfg := engine.SchedulerConfig{MaxModelLen: 64, Connector: coreAdapter{h}}
	if cfg.LoadFailurePolicy == PolicyRecompute {
		scfg.LoadFailurePolicy = engine.FailurePolicyRecompute
	}
	h.sched, err = engine.NewScheduler(pool, scfg)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// coreAdapter is the engine.Connector of the harness: the core's hooks at the harness's clock.
// Each hook's actions are checked against the contract (hookActions).
type coreAdapter struct{ h *coreHarness }

func (a coreAdapter) Arrived(seq *engine.Sequence) {
	a.h.k.arrived(seq, a.h.now)
	a.h.hookDone("Arrived")
}
func (a coreAdapter) MatchedExternal(seq *engine.Sequence, hit int) (int, bool) {
	defer a.h.hookDone("MatchedExternal")
	return a.h.k.matchedExternal(seq, hit, a.h.now)
}
func (a coreAdapter) AfterAlloc(seq *engine.Sequence, blocks []int32, n int) {
	a.h.k.afterAlloc(seq, blocks, n, a.h.now)
	a.h.hookDone("AfterAlloc")
}
func (a coreAdapter) Finished(seq *engine.Sequence, st engine.Status, _ time.Time) (bool, map[string]any) {
	defer a.h.hookDone("Finished")
	return a.h.k.finished(seq, st, a.h.now)
}
func (a coreAdapter) EvictHolds(blocks int) []string {
	defer a.h.hookDone("EvictHolds")
	return a.h.k.evictHolds(blocks, a.h.now)
}

// hookDone collects the actions of a hook of the engine's step loop, failing the test if they
// break the contract of actions: a hook never emits a synchronous action (beats, drops).
func (h *coreHarness) hookDone(hook string) {
	h.t.Helper()
	a := h.k.take()
	if err := hookActions(a); err != nil {
		h.t.Errorf("the %s hook: %v", hook, err)
	}
	mergeActions(h.t, &h.acts, a)
}

// hookActions checks the actions of a step-loop hook: the loop must never wait for a heartbeat
// (up to a second) or a peer's invalidation.
func hookActions(a actions) error {
	if len(a.beats) > 0 || len(a.drops) > 0 {
		return fmt.Errorf("emitted synchronous actions (%d beats, %d drops): the engine's step loop would wait for them", len(a.beats), len(a.drops))
	}
	return nil
}

// collect moves the core's actions into the harness.
func (h *coreHarness) collect() { mergeActions(h.t, &h.acts, h.k.take()) }

// takeActs returns and clears what the core asked for.
func (h *coreHarness) takeActs() actions {
	h.collect()
	a := h.acts
	h.acts = actions{}
	return a
}

// run adds a request and steps the scheduler until it finishes, sampling token 7 each time; it
// returns the params the request finished with.
func (h *coreHarness) run(id string, prompt []int32, maxTokens int, kv map[string]any) map[string]any {
	h.t.Helper()
	if _, err := h.sched.Add(&engine.Request{ID: id, Prompt: prompt, MaxTokens: maxTokens, KVTransfer: kv}, h.now); err != nil {
		h.t.Fatal(err)
	}
	for range 100 {
		plan := h.sched.Schedule(h.now)
		sampled := make([]int32, len(plan.Work))
		for i := range sampled {
			sampled[i] = 7
		}
		for _, ev := range h.sched.Update(h.now, sampled) {
			if ev.Seq.ID() == id && ev.Seq.Status().Finished() {
				return viaJSON(h.t, ev.KVTransfer)
			}
		}
	}
	h.t.Fatalf("request %s did not finish", id)
	return nil
}

// viaJSON round-trips params through JSON, as they travel between engines.
func viaJSON(t *testing.T, m map[string]any) map[string]any {
	t.Helper()
	if m == nil {
		return nil
	}
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	var out map[string]any
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatal(err)
	}
	return out
}

// template is what a proxy sends P.
func template() map[string]any {
	return map[string]any{"do_remote_decode": true, "do_remote_prefill": false}
}

func ids(n int32) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = 100 + int32(i)
	}
	return out
}

// TestCoreProducerLease: a producer's finished request holds its blocks under a fresh token; its
// records and the lease's tag are published before the params leave the hook; a notification
// with another token changes nothing, the owner's ends the lease (a release action), a late one
// is unknown and counted.
func TestCoreProducerLease(t *testing.T) {
	h := newCoreHarness(t, `{"kv_connector":"NixlConnector","kv_role":"kv_producer"}`)
	prompt := ids(10) // two full blocks and a partial one of 2 tokens
	raw := h.run("p1", prompt, 1, template())
	p, err := ParseParams(raw)
	if err != nil || !p.HasLease || !p.DoRemotePrefill || p.RemoteNumTokens != 10 || len(p.Blocks()) != 3 || p.Instance != "inst-self" {
		t.Fatalf("P's params %+v %v", p, err)
	}
	slot := h.k.slots[p.LeaseSlot*slotBytes : p.LeaseSlot*slotBytes+16]
	if tag := kvlease.Tag(p.Lease, 10, p.Blocks(), p.BlockGenerations); string(slot) != string(tag[:]) {
		t.Error("the slot does not hold the lease's tag")
	}
	chain := kvcache.ChainHashes(prompt, coreBlockSize)
	for i, want := range []kvcache.Record{
		{Gen: p.BlockGenerations[0], Count: 4, Hash: chain[0]},
		{Gen: p.BlockGenerations[1], Count: 4, Hash: chain[1]},
		{Gen: p.BlockGenerations[2], Count: 2, Hash: kvcache.NextHash(chain[1], prompt[8:])},
	} {
		rec := kvcache.DecodeRecord(h.records[int(p.Blocks()[i])*kvcache.RecordBytes:])
		if rec != want {
			t.Errorf("block %d record %+v, want %+v", i, rec, want)
		}
	}
	release := func(tok kvlease.Token, prompt []int32) string {
		return kvlease.FormatRelease(kvlease.Release{ID: "p1", Readers: 1, Token: tok, Proven: len(prompt), Proof: kvlease.Proof(tok, prompt)})
	}
	wrong := p.Lease
	wrong[0]++
	h.k.notification("d", release(wrong, prompt), h.now)
	if a := h.takeActs(); len(a.release) != 0 || h.k.counts.notifications.Load() != 1 {
		t.Fatalf("a notification with another token: %+v, refused %d", a, h.k.counts.notifications.Load())
	}
	h.k.notification("d", release(p.Lease, prompt), h.now)
	if a := h.takeActs(); !slices.Equal(a.release, []string{"p1"}) {
		t.Fatalf("the owner's notification: %+v", a)
	}
	if string(slot) != string(make([]byte, 16)) {
		t.Error("the ended lease's tag is still published")
	}
	h.k.notification("d", release(p.Lease, prompt), h.now)
	if h.takeActs().release != nil {
		t.Error("a late notification released again")
	}
}

// pullParams returns, as they travel, the params of a producer "P" (instance "i", at h:1) whose
// two blocks hold 8 tokens under lease token tok, with tp_size given so that D heartbeats.
func pullParams(t *testing.T, tok kvlease.Token) map[string]any {
	t.Helper()
	return viaJSON(t, (&Params{DoRemotePrefill: true, RemoteBlockIDs: [][]int32{{1, 2}}, RemoteEngineID: "P", RemoteRequestID: "p1",
		RemoteHost: "h", RemotePort: 1, TPSize: 1, RemoteNumTokens: 8, BlockGenerations: []uint64{1, 1}, Instance: "i",
		Lease: tok, HasLease: true, LeaseSlot: 0}).Map())
}

// TestLoadFailsWithArrivalHandshake: a request whose arrival started a handshake that failed
// (and was forgotten) fails with that handshake's error when its load starts, however much later:
// it does not start a second handshake, whose outcome would depend on when the load began.
func TestLoadFailsWithArrivalHandshake(t *testing.T) {
	h := newCoreHarness(t, `{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}`)
	kv := pullParams(t, kvlease.Token{9})
	if _, err := h.sched.Add(&engine.Request{ID: "d1", Prompt: ids(8), MaxTokens: 4, KVTransfer: kv}, h.now); err != nil {
		t.Fatal(err)
	}
	a := h.takeActs()
	if len(a.handshakes) != 1 {
		t.Fatalf("arrival: %+v", a)
	}
	r := a.handshakes[0]
	cut := fmt.Errorf("%w with h:1: unexpected EOF", ErrHandshake)
	h.k.handshakeEnded(r.key, nil, cut)
	if h.k.remotes[r.key] != nil {
		t.Fatal("the failed record stayed")
	}
	h.sched.Schedule(h.now) // admission: the load starts after the handshake failed
	a = h.takeActs()
	if len(a.loads) != 1 || len(a.handshakes) != 0 {
		t.Fatalf("admission: %+v", a)
	}
	// The worker's side of the load: with no connector around it (no side channel, no agent),
	// anything beyond the failed handshake would panic.
	c := &Connector{geo: h.k.geo}
	if bad, err := c.load(t.Context(), a.loads[0], nil); !errors.Is(err, cut) || bad != 0 {
		t.Fatalf("load: first bad block %d, error %v; want block 0 and %v", bad, err, cut)
	}
}

// TestLoadWaitsForArrivalHandshake: a request admitted while the handshake its arrival started
// still runs gets a load that waits for that handshake (the worker's flight of it) and fails
// with its error, whichever of the load and the handshake's end comes first.
func TestLoadWaitsForArrivalHandshake(t *testing.T) {
	h := newCoreHarness(t, `{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}`)
	kv := pullParams(t, kvlease.Token{9})
	if _, err := h.sched.Add(&engine.Request{ID: "d1", Prompt: ids(8), MaxTokens: 4, KVTransfer: kv}, h.now); err != nil {
		t.Fatal(err)
	}
	hs := h.takeActs().handshakes
	if len(hs) != 1 {
		t.Fatalf("arrival: %d handshakes", len(hs))
	}
	// The worker around the core, without agent or side channel: nothing here may reach them.
	c := &Connector{core: h.k, geo: h.k.geo, log: testLogger(io.Discard), now: func() time.Time { return h.now },
		flights: map[remoteKey]*flight{}, ctx: t.Context()}
	h.sched.Schedule(h.now) // admission while the handshake runs: the load awaits it
	loads := h.takeActs().loads
	if len(loads) != 1 || !loads[0].awaiting {
		t.Fatalf("admission: loads %+v", loads)
	}
	var f *flight
	c.locked(func() { f = c.flightLocked(loads[0].handshake) }) // as takeLocked does
	type result struct {
		bad int
		err error
	}
	done := make(chan result, 1)
	c.wg.Add(1) // as takeLocked counted it for perform
	go func() {
		defer c.wg.Done()
		bad, err := c.load(t.Context(), loads[0], f)
		done <- result{bad, err}
	}()
	cut := fmt.Errorf("%w with h:1: unexpected EOF", ErrHandshake)
	c.endHandshake(hs[0], nil, cut)
	select {
	case r := <-done:
		if !errors.Is(r.err, cut) || r.bad != 0 {
			t.Fatalf("load: first bad block %d, error %v; want block 0 and %v", r.bad, r.err, cut)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the load did not end with the handshake")
	}
	if len(c.flights) != 0 || h.k.remotes[hs[0].key] != nil {
		t.Errorf("after the handshake failed: %d flights, record %v", len(c.flights), h.k.remotes[hs[0].key])
	}
}

// TestCoreLoadFinished: what a finished load asks of the scheduler.
func TestCoreLoadFinished(t *testing.T) {
	gone := fmt.Errorf("%w: slot", errLeaseGone)
	for _, tc := range []struct {
		name     string
		fromD    bool
		finished bool
		err      error
		want     string
	}{
		{"ok", false, false, nil, "loaded"},
		{"failed", false, false, transfer.ErrRemoteDisconnect, "failed"},
		{"lease gone on P", false, false, gone, "failed"},
		{"hold gone on D", true, false, gone, "missed"},
		{"hold refused over TCP", true, false, transfer.ErrPermission, "missed"},
		{"corrupt hold", true, false, ErrVerification, "failed"},
		{"request finished meanwhile", false, true, nil, "release"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newCoreHarness(t, `{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}`)
			h.k.reqs["r"] = &reqState{loading: true, finished: tc.finished}
			h.k.loadFinished(loadJob{id: "r", params: &Params{}, fromD: tc.fromD}, 3, tc.err, false, h.now)
			a := h.takeActs()
			got := ""
			switch {
			case len(a.loaded) == 1:
				got = "loaded"
			case len(a.missed) == 1:
				got = "missed"
			case len(a.release) == 1:
				got = "release"
			case a.failed["r"] == 3:
				got = "failed"
			}
			if got != tc.want {
				t.Errorf("got %q (%+v), want %q", got, a, tc.want)
			}
		})
	}
}

// TestCoreHoldGoneIsAMiss: a decoder's hold that expired or was evicted (its slot cleared, as
// verifyRead reports it, or its READ refused over TCP) is a cache miss: recomputed, not a
// verification refusal, not a failed transfer, not an error in the log. A producer's lease gone
// before D read is still all three.
func TestCoreHoldGoneIsAMiss(t *testing.T) {
	p := &Params{RemoteBlockIDs: [][]int32{{7}}, RemoteNumTokens: 4, BlockGenerations: []uint64{1}, Lease: kvlease.Token{9}}
	plan := readPlan{localIndex: []int{0}, remoteIndex: []int{0}, scratch: []int{0}}
	_, cleared := verifyRead(loadJob{id: "r", params: p, prompt: ids(4)}, "D", coreBlockSize, plan, nil, make([]byte, 16))
	if !errors.Is(cleared, errLeaseGone) {
		t.Fatalf("a cleared slot: %v", cleared)
	}
	for _, tc := range []struct {
		name         string
		fromD        bool
		err          error
		want         string
		verification int64
		failed       int
	}{
		{"evicted hold", true, cleared, "missed", 0, 0},
		{"hold refused over TCP", true, transfer.ErrPermission, "missed", 0, 0},
		{"lease gone on P", false, cleared, "failed", 1, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newCoreHarness(t, `{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}`)
			var log fixture.LogBuffer
			h.k.log = testLogger(&log)
			h.k.reqs["r"] = &reqState{loading: true}
			h.k.loadFinished(loadJob{id: "r", params: p, fromD: tc.fromD}, 0, tc.err, false, h.now)
			a := h.takeActs()
			switch tc.want {
			case "missed":
				if len(a.missed) != 1 || a.failed != nil {
					t.Errorf("actions %+v, want a miss", a)
				}
			case "failed":
				if _, ok := a.failed["r"]; !ok || len(a.missed) != 0 {
					t.Errorf("actions %+v, want a failure", a)
				}
			}
			if got := h.k.counts.verification.Load(); got != tc.verification {
				t.Errorf("%d verification refusals, want %d", got, tc.verification)
			}
			if got := h.nixl.TakeInterval().FailedTransfers; got != tc.failed {
				t.Errorf("%d failed transfers, want %d", got, tc.failed)
			}
			if logged := strings.Contains(log.String(), "level=ERROR"); logged != (tc.failed > 0) {
				t.Errorf("error logged %v, want %v: %s", logged, tc.failed > 0, log.String())
			}
		})
	}
}

// TestCoreExpiredHold: P declines a turn-2 read when it would end within 5 s of D's TTL, on D's
// clock rebased through the handshake's offset (spec item 35).
func TestCoreExpiredHold(t *testing.T) {
	h := newCoreHarness(t, `{"kv_connector":"NixlConnector","kv_role":"kv_producer"}`)
	exp := func(v float64) *Params { return &Params{RemoteBlocksExpiryTime: &v} }
	for _, tc := range []struct {
		p       *Params
		offset  float64
		now     time.Duration
		expired bool
	}{
		{&Params{}, 0, time.Hour, false},
		{exp(100), 0, 94 * time.Second, false},
		{exp(100), 0, 95 * time.Second, true},
		{exp(100), 50, 44 * time.Second, false}, // D's clock runs 50 s ahead
		{exp(100), 50, 45 * time.Second, true},
	} {
		if got := h.k.expiredHold(tc.p, tc.offset, t0.Add(tc.now)); got != tc.expired {
			t.Errorf("expiry %v, offset %v, now %v: expired %v", tc.p.RemoteBlocksExpiryTime, tc.offset, tc.now, got)
		}
	}
}

// TestCoreEvictHolds: decoder holds are evicted oldest first, their tags withdrawn; a
// producer's lease never is.
func TestCoreEvictHolds(t *testing.T) {
	h := newCoreHarness(t, `{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"bidirectional_kv_xfer":true}}`)
	// Turns of a decoder: finished requests whose params came from a producer.
	var slots []int
	for i, id := range []string{"old", "new"} {
		h.now = t0.Add(time.Duration(i) * time.Second)
		kv := map[string]any{"do_remote_prefill": true} // no remote blocks: computed locally, then held
		raw := h.run(id, ids(6), 2, kv)
		p, err := ParseParams(raw)
		if err != nil || !p.HasLease || !p.DoRemoteDecode {
			t.Fatalf("%s: D's params %+v %v", id, p, err)
		}
		slots = append(slots, p.LeaseSlot)
	}
	if got := h.k.evictHolds(1, h.now); !slices.Equal(got, []string{"old"}) {
		t.Fatalf("evicted %v, want [old]", got)
	}
	if s := h.k.slots[slots[0]*slotBytes : slots[0]*slotBytes+16]; string(s) != string(make([]byte, 16)) {
		t.Error("an evicted hold's tag is still published")
	}
	if got := h.k.evictHolds(100, h.now); !slices.Equal(got, []string{"new"}) || h.k.counts.evictedHolds.Load() != 2 {
		t.Fatalf("evicted %v (counted %d), want [new]", got, h.k.counts.evictedHolds.Load())
	}
}

// TestCoreDeclineAndRefusals: declined params (a request refused before the engine, whose
// prompt the connector never sees) send nothing — without the prompt no release can be proven,
// and the producer frees at lease expiry; params without a lease, with a bad MAC or naming a
// host outside allowed_peers are refused and counted, and nothing is dialled.
func TestCoreDeclineAndRefusals(t *testing.T) {
	good := &Params{DoRemotePrefill: true, RemoteBlockIDs: [][]int32{{1}}, RemoteEngineID: "P", RemoteRequestID: "p1",
		RemoteHost: "10.1.2.3", RemotePort: 1, BlockGenerations: []uint64{1}, Instance: "i", Lease: kvlease.Token{1}, HasLease: true, LeaseSlot: 0}
	for _, tc := range []struct {
		name    string
		extra   string
		change  func(*Params)
		refused bool
	}{
		{"good", ``, nil, false},
		{"no lease", ``, func(p *Params) { p.HasLease = false }, true},
		{"no instance", ``, func(p *Params) { p.Instance = "" }, true},
		{"allowed host", `"allowed_peers":["10.0.0.0/8"]`, nil, false},
		{"host outside allowed_peers", `"allowed_peers":["192.168.0.0/16"]`, nil, true},
		{"no MAC with a token", `"auth_token":"tok-0123456789abcdef"`, nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newCoreHarness(t, `{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_connector_extra_config":{`+tc.extra+`}}`)
			p := *good
			if tc.change != nil {
				tc.change(&p)
			}
			h.k.decline(viaJSON(t, p.Map()), h.now)
			a := h.takeActs()
			if refused := h.k.counts.params.Load() == 1; refused != tc.refused || len(a.notifies) != 0 || len(a.handshakes) != 0 {
				t.Errorf("refused %v, notifies %d, handshakes %d; want refused %v and nothing sent", refused, len(a.notifies), len(a.handshakes), tc.refused)
			}
		})
	}
}

// TestVerifyRead: what a read brought is used only if the slot holds the params' tag and each
// record matches the reader's own prompt.
func TestVerifyRead(t *testing.T) {
	prompt := ids(10)
	chain := kvcache.ChainHashes(prompt, coreBlockSize)
	tok := kvlease.Token{3}
	p := &Params{RemoteBlockIDs: [][]int32{{7, 8, 9}}, RemoteNumTokens: 10, BlockGenerations: []uint64{4, 4, 5}, Lease: tok}
	tag := kvlease.Tag(tok, 10, p.Blocks(), p.BlockGenerations)
	record := func(gen uint64, count int, hash kvcache.BlockHash) []byte {
		b := make([]byte, kvcache.RecordBytes)
		binary.LittleEndian.PutUint64(b, gen)
		binary.LittleEndian.PutUint32(b[8:], uint32(count))
		copy(b[16:], hash[:])
		return b
	}
	good := [][]byte{record(4, 4, chain[0]), record(4, 4, chain[1]), record(5, 2, kvcache.NextHash(chain[1], prompt[8:]))}
	plan := readPlan{localIndex: []int{0, 1, 2}, remoteIndex: []int{0, 1, 2}, scratch: []int{0, 1, 2}}
	j := loadJob{id: "r", params: p, prompt: prompt}
	for _, tc := range []struct {
		name    string
		slot    []byte
		records func([][]byte) [][]byte
		prompt  []int32
		bad     int
		want    error
	}{
		{"ok", tag[:], nil, nil, 0, nil},
		{"slot cleared", make([]byte, 16), nil, nil, 0, errLeaseGone},
		{"generation", tag[:], func(r [][]byte) [][]byte { r[1] = record(3, 4, chain[1]); return r }, nil, 1, ErrStaleBlocks},
		{"count", tag[:], func(r [][]byte) [][]byte { r[2] = record(5, 3, kvcache.NextHash(chain[1], prompt[8:])); return r }, nil, 2, ErrVerification},
		{"another prompt", tag[:], func(r [][]byte) [][]byte { r[0] = record(4, 4, chain[1]); return r }, nil, 0, ErrVerification},
		{"beyond the prompt", tag[:], nil, prompt[:9], 2, ErrVerification},
	} {
		t.Run(tc.name, func(t *testing.T) {
			recs := slices.Clone(good)
			if tc.records != nil {
				recs = tc.records(recs)
			}
			jj := j
			if tc.prompt != nil {
				jj.prompt = tc.prompt
			}
			bad, err := verifyRead(jj, "P", coreBlockSize, plan, recs, tc.slot)
			if tc.want == nil {
				if err != nil {
					t.Fatalf("verify: %v", err)
				}
				return
			}
			if !errors.Is(err, tc.want) || bad != tc.bad {
				t.Fatalf("verify: block %d, %v; want block %d, %v", bad, err, tc.bad, tc.want)
			}
		})
	}
}

// releaseOf returns the release notification a reader core sends for a request carrying kv
// with prompt: the one its load carries, or the one it sends when it reads nothing.
func (h *coreHarness) releaseOf(id string, prompt []int32, kv map[string]any) string {
	h.t.Helper()
	if _, err := h.sched.Add(&engine.Request{ID: id, Prompt: prompt, MaxTokens: 1, KVTransfer: kv}, h.now); err != nil {
		h.t.Fatal(err)
	}
	h.sched.Schedule(h.now)
	a := h.takeActs()
	switch {
	case len(a.loads) == 1 && len(a.notifies) == 0:
		return string(a.loads[0].release)
	case len(a.notifies) == 1 && len(a.loads) == 0:
		return string(a.notifies[0].msg)
	}
	h.t.Fatalf("request %s: want one load or one notification, got %+v", id, a)
	return ""
}

// TestCoreReleaseNeedsThePrompt: the owner of a lease ends it only on a release notification
// from a reader that holds the prompt it was issued for. Readers are real cores given the
// owner's params with their own prompts; what they send (with a read, or without one below the
// threshold) is handed to the owner. Another prompt, a shorter one or one edited anywhere leaves
// the lease held, counted; the victim's own release, or one from a prompt that starts with the
// lease's (the residual case: it holds the prompt), ends it. A decoder's hold (bidirectional)
// is ended by the next turn's prefiller even when the answer it appends was tokenized otherwise,
// but not by one whose prompt differs.
func TestCoreReleaseNeedsThePrompt(t *testing.T) {
	const (
		producer = `{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":{"bidirectional_kv_xfer":true,"kv_recompute_threshold":0}}`
		consumer = `{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"bidirectional_kv_xfer":true}}`
		lazy     = `{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"kv_recompute_threshold":1000}}`
	)
	edit := func(p []int32, at int) []int32 {
		p = slices.Clone(p)
		p[at]++
		return p
	}
	type reader struct {
		name     string
		config   string
		prompt   []int32
		released bool
	}
	for _, tc := range []struct {
		name    string
		owner   string
		run     func(h *coreHarness) (map[string]any, []int32) // the lease's params and content
		readers func(content []int32) []reader
	}{{
		name:  "producer's lease",
		owner: producer,
		run: func(h *coreHarness) (map[string]any, []int32) {
			return h.run("r1", ids(10), 1, template()), ids(10)
		},
		readers: func(c []int32) []reader {
			return []reader{
				{"another prompt", consumer, ids(10)[1:], false},
				{"edited at its last token", consumer, edit(c, 9), false},
				{"edited at its first token", consumer, edit(c, 0), false},
				{"a prefix of it", consumer, c[:8], false},
				{"another prompt, below the threshold", lazy, edit(c, 3), false},
				{"the prompt, below the threshold", lazy, c, true},
			}
		},
	}, {
		name:  "producer's lease, read by a longer prompt",
		owner: producer,
		run: func(h *coreHarness) (map[string]any, []int32) {
			return h.run("r1", ids(10), 1, template()), ids(10)
		},
		readers: func(c []int32) []reader {
			return []reader{{"the prompt and more", consumer, append(slices.Clone(c), 1, 2, 3), true}}
		},
	}, {
		name:  "decoder's hold",
		owner: consumer,
		run: func(h *coreHarness) (map[string]any, []int32) {
			kv := h.run("t1", ids(10), 6, map[string]any{"do_remote_prefill": true})
			// The hold is the prompt and the answer but its last token (never computed).
			content := append(ids(10), 7, 7, 7, 7, 7)
			kv["do_remote_decode"], kv["do_remote_prefill"] = true, false // as the multi-turn proxy sends it to P
			return kv, content
		},
		readers: func(c []int32) []reader {
			next := append(slices.Clone(c), 7, 1, 2) // the next turn: history, then a new message
			return []reader{
				{"another conversation", producer, ids(18)[1:], false},
				{"history edited inside the prompt", producer, edit(next, 5), false},
				{"history edited in the first block", producer, edit(next, 0), false},
				{"the next turn, its answer tokenized otherwise", producer, edit(next, 13), true},
			}
		},
	}, {
		name:  "decoder's hold, the exact continuation",
		owner: consumer,
		run: func(h *coreHarness) (map[string]any, []int32) {
			kv := h.run("t1", ids(10), 6, map[string]any{"do_remote_prefill": true})
			kv["do_remote_decode"], kv["do_remote_prefill"] = true, false
			return kv, append(ids(10), 7, 7, 7, 7, 7)
		},
		readers: func(c []int32) []reader {
			return []reader{{"the next turn", producer, append(slices.Clone(c), 7, 1, 2), true}}
		},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			owner := newCoreHarness(t, tc.owner)
			kv, content := tc.run(owner)
			p, err := ParseParams(kv)
			if err != nil || !p.HasLease {
				t.Fatalf("the owner's params: %+v %v", p, err)
			}
			if p.RemoteNumTokens != len(content) {
				t.Fatalf("the lease holds %d tokens, the test expects %d", p.RemoteNumTokens, len(content))
			}
			refused := int64(0)
			for i, r := range tc.readers(content) {
				msg := newCoreHarness(t, r.config).releaseOf(fmt.Sprintf("x%d", i), r.prompt, kv)
				owner.k.notification("reader", msg, owner.now)
				a := owner.takeActs()
				if released := slices.Equal(a.release, []string{p.RemoteRequestID}); released != r.released {
					t.Fatalf("%s: the lease ended %v, want %v (%q)", r.name, released, r.released, msg)
				}
				if !r.released {
					refused++
				}
				if got := owner.k.counts.notifications.Load(); got != refused {
					t.Errorf("%s: %d notifications refused, want %d", r.name, got, refused)
				}
			}
			if owner.k.leases.Len() != 0 {
				t.Errorf("%d leases left", owner.k.leases.Len())
			}
		})
	}
}

// TestReleaseLengths: how many leading tokens of a lease a release may prove.
func TestReleaseLengths(t *testing.T) {
	for _, tc := range []struct {
		numTokens, prompt int
		hold              bool
		want              []int
	}{
		{10, 10, false, []int{10}},
		{15, 10, true, []int{8, 12, 15}},  // from the block boundary before the prompt's last token
		{16, 9, true, []int{8, 12, 16}},   // the prompt's last token starts a block
		{16, 12, true, []int{8, 12, 16}},  // …or ends one
		{7, 3, true, []int{4, 7}},         // at least one block
		{3, 2, true, []int{3}},            // less than a block: all of it
		{24, 20, true, []int{16, 20, 24}}, // aligned throughout
	} {
		if got := releaseLengths(tc.numTokens, tc.prompt, coreBlockSize, tc.hold); !slices.Equal(got, tc.want) {
			t.Errorf("releaseLengths(%d, %d, hold %v) = %v, want %v", tc.numTokens, tc.prompt, tc.hold, got, tc.want)
		}
	}
}

// counter returns the value of counter name (summed over its series) in h's registry.
func (h *coreHarness) counter(name string) float64 {
	h.t.Helper()
	mfs, err := h.reg.Prometheus().Gather()
	if err != nil {
		h.t.Fatal(err)
	}
	var v float64
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				v += m.GetCounter().GetValue()
			}
		}
	}
	return v
}

// TestCoreDecoderHoldExpiry: a bidirectional decoder's hold that reaches decoder_kv_blocks_ttl
// unclaimed is released and counted as a hold that expired, not as an expired KV request (P's
// lease signal), and the holds that expire within one quiet interval make one summary.
func TestCoreDecoderHoldExpiry(t *testing.T) {
	h := newCoreHarness(t, `{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"bidirectional_kv_xfer":true,"decoder_kv_blocks_ttl":100}}`)
	hold := func(id string, at time.Duration) {
		h.now = t0.Add(at)
		if p, err := ParseParams(h.run(id, ids(6), 2, map[string]any{"do_remote_prefill": true})); err != nil || !p.HasLease {
			t.Fatalf("%s: D's params %+v %v", id, p, err)
		}
	}
	tick := func(at time.Duration) actions {
		h.now = t0.Add(at)
		h.k.tick(h.now)
		a := h.takeActs()
		for _, id := range a.release {
			h.sched.ReleaseDelayed(id)
		}
		return a
	}
	hold("a", 0)
	hold("b", 1*time.Second)
	hold("c", 2*time.Second)
	h.takeActs()
	if a := tick(99 * time.Second); len(a.release) != 0 || a.holdsExpired != 0 {
		t.Fatalf("before the TTL: %+v", a)
	}
	// The first expiry is summed up at once; the next two, within quietInterval of it, wait.
	if a := tick(100 * time.Second); !slices.Equal(a.release, []string{"a"}) || a.holdsExpired != 1 {
		t.Fatalf("at the TTL: released %v, summary %d", a.release, a.holdsExpired)
	}
	if a := tick(102 * time.Second); len(a.release) != 2 || a.holdsExpired != 0 {
		t.Fatalf("within the quiet interval: released %v, summary %d", a.release, a.holdsExpired)
	}
	if a := tick(100*time.Second + quietInterval); a.holdsExpired != 2 || a.holdsSince != quietInterval {
		t.Fatalf("after the quiet interval: summary %d over %v, want 2 over %v", a.holdsExpired, a.holdsSince, quietInterval)
	}
	if a := tick(200 * time.Second); a.holdsExpired != 0 {
		t.Fatalf("a summary of nothing: %d", a.holdsExpired)
	}
	if got := h.counter("kvbridge:decoder_holds_expired_total"); got != 3 {
		t.Errorf("kvbridge:decoder_holds_expired_total = %v, want 3", got)
	}
	if got := h.counter("vllm:nixl_num_kv_expired_reqs_total"); got != 0 || h.nixl.TakeInterval().ExpiredRequests != 0 {
		t.Errorf("vllm:nixl_num_kv_expired_reqs_total = %v: a decoder's hold is not an expired KV request", got)
	}
	if free := h.pool.NumFree(); free != h.pool.NumBlocks() {
		t.Errorf("%d of %d blocks free after every hold expired", free, h.pool.NumBlocks())
	}
}
