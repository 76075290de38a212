package connector

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/kvbridge/kvbridge/engine"
	"github.com/kvbridge/kvbridge/internal/kvlease"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/metrics"
	"github.com/kvbridge/kvbridge/transfer"
)

// The connector is split the way etcd's raft splits RawNode from Node. The core (this file) is
// the NixlConnector's bookkeeping: the engine's hooks, leases and their published tags,
// heartbeats, notifications, expiry, the records of remote engines and what to do with a
// finished load. It is a deterministic state machine: every event comes with the time, and what
// must happen outside — a handshake, a load, a notification to send, a record to drop, a
// scheduler call — is appended to its actions, which the Connector (connector.go, worker.go)
// takes after each event and performs. It starts no goroutine, does no network I/O and reads no
// clock; its only side effects are on the KV pool and the lease slots in shared memory, which
// must be published before the params that name them leave the hook. Not safe for concurrent
// use: the Connector holds its mutex around every call.

// core is the connector's deterministic state machine. All of it is guarded by the Connector's
// mutex (Connector.apply); counts alone are atomic, read without it.
type core struct {
	cfg       *Config
	pool      *kvcache.Pool
	geo       kvcache.Geometry
	layout    ArenaLayout
	slots     []byte // the lease slots this engine publishes
	log       *slog.Logger
	metrics   *metrics.NixlMetrics
	epoch     time.Time
	engineID  string
	instance  string // random per start; named in the params this engine issues
	host      string // remote_host of the params this engine issues
	port      int
	peers     *peerFilter // allowed_peers; nil allows all
	paramsKey []byte      // MAC key of issued and accepted params; nil without an auth token
	random    io.Reader   // lease tokens (crypto/rand)
	vocab     int         // the model's vocabulary size (Options.VocabSize); 0: no first tokens

	// kvRegion and metaRegion are the regions peers may read (0 before registration).
	kvRegion, metaRegion uint32
	// rankRegions are the KV regions of tensor-parallel ranks 1, 2, … (rank 0's is kvRegion);
	// block i lies at the same offset in each.
	rankRegions []uint32
	// kvHeads is the model's KV heads, every rank's (0: geo.NumKVHeads × the TP size).
	kvHeads int

	reqs        map[string]*reqState
	leases      kvlease.Table
	heartbeats  kvlease.HeartbeatTracker
	remotes     map[remoteKey]*remoteRecord
	push        pushState // push mode (push.go)
	handshaking int
	quiet       logLimiter
	counts      *counters
	closed      bool

	// holdsExpired counts the decoder holds that expired unclaimed since the last summary line,
	// written at holdsSummarized (at most one per quietInterval).
	holdsExpired    int
	holdsSummarized time.Time

	out actions
}

// counters are the core's counts, read without the lock (AuthRefusals, the collector).
type counters struct {
	rejections                                        atomic.Int64 // pulls cut short by hash hints
	params, notifications, verification, evictedHolds atomic.Int64
	paramsMAC                                         atomic.Int64 // of params: refused for their MAC
}

// actions are what the core asks its worker to do; take returns and clears them. The Connector
// takes them after every event, under its mutex, and performs them once the mutex is released
// (Connector.perform), field by field in the order of the fields below, each field's entries in
// order.
//
// The engine's step loop must never wait: the events of its hooks (arrived, matchedExternal,
// afterAlloc, finished, evictHolds, decline) never emit the synchronous actions, beats and
// drops, which the worker performs on the goroutine that handed it the event. Every other
// action is asynchronous (a goroutine the Connector owns) or a call into the scheduler that does
// not block. The trace tests (TestCoreTraces) check this on every hook.
type actions struct {
	// drops: forget a record's link — invalidate its transfer peer's incarnation and release its
	// descriptor lists. Synchronous. Emitted by tick (idle past engine_ttl), peerLost, forget
	// (the worker saw the peer gone) and handshakeEnded (a link nobody waits for).
	drops []*remoteLink
	// handshakes: run the side-channel handshake with a new record, on a goroutine, and hand
	// its outcome back (handshakeEnded). Emitted where a record is created (entry): arrived and
	// matchedExternal (the proactive handshake of a consumer), tick (a heartbeat whose record
	// was dropped) and the worker's own lookups (a load or a notification).
	handshakes []handshakeJob
	// loads: read remote KV into local blocks, on a goroutine, and hand the outcome back
	// (loadFinished). Emitted by afterAlloc only.
	loads []loadJob
	// registers: (push decoder) send a registration of destination blocks, or a cancel, to a
	// producer once its handshake is done, on a goroutine; a registration that cannot be sent
	// ends its load (pushFailed). Emitted by afterAlloc and finished.
	registers []registerJob
	// pushes: (push producer) WRITE a finished request's KV into a decoder's registered blocks,
	// on a goroutine, with the completion attached, and report the end (pushEnded). Emitted by
	// notification (a registration) and finished (a parked one).
	pushes []pushJob
	// pushNotices: (push producer) tell a decoder at once, on a goroutine, that its
	// registration will not be written. Emitted by notification and tick.
	pushNotices []pushNotice
	// notifies: tell a producer that this engine will not read its blocks, on a goroutine.
	// Emitted by afterAlloc (nothing to load) and finished (aborted before its read).
	notifies []notice
	// holdsExpired, when not zero, is a summary to log: that many decoder holds expired
	// unclaimed since the previous summary, holdsSince before now (zero: since the start).
	// Emitted by tick.
	holdsExpired int
	holdsSince   time.Duration
	// beats: send a heartbeat batch to a handshaken producer, waiting up to a second.
	// Synchronous. Emitted by tick only.
	beats []beat
	// release: Scheduler.ReleaseDelayed — a lease or hold ended (notification, tick) or a
	// finished request's load ended (loadFinished).
	release []string
	// loaded and failed: one Scheduler.LoadsDone call — successes, and failures with their
	// first bad block. missed: Scheduler.LoadsMissed — a decoder's hold that was gone. Emitted
	// by loadFinished: when a load ends, or at once by afterAlloc once the connector is
	// closing.
	loaded []string
	first  map[string]engine.FirstToken // (push decoder) the producer's first tokens of loaded requests
	failed map[string]int
	missed []string
}

// notice is a release notification for the producer named by params.
type notice struct {
	params *Params
	msg    []byte // kvlease.FormatRelease
}

// beat is one heartbeat message for one producer.
type beat struct {
	peer string
	msg  []byte
	// ranks is the producer's TP size: vLLM sends each heartbeat to every rank's agent, so a
	// beat that cannot be sent counts that many failed notifications (0 counts as 1).
	ranks int
}

// take returns the actions accumulated since the last call.
func (k *core) take() actions {
	a := k.out
	k.out = actions{}
	return a
}

// reqState is the core's bookkeeping of one live request.
type reqState struct {
	params    *Params
	processed bool      // AfterAlloc ran: never read twice (vLLM's _remote_blocks_processed)
	loading   bool      // a load owns the request's blocks
	finished  bool      // the engine finished the request while it was loading
	tracked   bool      // heartbeats are being sent for it
	pullFromD bool      // a bidirectional turn: P pulls D's blocks
	push      *pushDest // a push decoder's registration, while it waits for the write
	digest    []byte    // a push producer's prompt digest, once computed (pushstream.go)
	streaming bool      // a push producer streams this request layer by layer (pushstream.go)

	// handshake names the record whose handshake was in progress when the request arrived
	// (awaiting, until it ends), and handshakeErr the error it failed with. The request's load
	// waits for that handshake and fails with it: a failed record is forgotten at once, and a
	// load that asked anew would start a second handshake whose outcome depends on when the
	// load happened to start.
	handshake    handshakeJob
	awaiting     bool
	handshakeErr error
}

// loadJob is one request's pull of remote KV into its own blocks.
type loadJob struct {
	id       string
	params   *Params
	blocks   []int32 // the request's whole block table
	prompt   []int32 // the request's prompt: what the remote blocks must hold
	localHit int     // tokens already in the leading blocks (a multiple of the block size)
	count    int     // tokens to load after them
	fromD    bool    // a bidirectional turn: the producer is a decoder with a TTL
	release  []byte  // the release notification the read carries (kvlease.FormatRelease)
	// first, on a push decoder's successful load, is the producer's first token, verified
	// (pushCompleted): it goes with the load to the scheduler.
	first *engine.FirstToken

	// The handshake the request's arrival found in progress (reqState.handshake): awaiting, the
	// worker waits for it before reading; handshakeErr, it failed and so does the load.
	handshake    handshakeJob
	awaiting     bool
	handshakeErr error
}

// remoteKey names one incarnation of a remote engine: its engine id and its instance (random per
// start). Records are keyed by both, so params naming a new address or a new instance of a
// known engine never replace a healthy record by themselves. While a record's handshake runs,
// nothing but its end removes it: a key names at most one handshake in progress.
type remoteKey struct{ engine, instance string }

// String renders the key as engine/instance (logs and traces).
func (key remoteKey) String() string { return key.engine + "/" + key.instance }

// remoteRecord is the core's record of a producer it has handshaken with or is handshaking
// with. The core creates it (entry) and asks for its handshake; the worker runs it and hands
// the outcome back as a value (handshakeEnded).
type remoteRecord struct {
	key  remoteKey
	addr string // where the handshake goes

	// link is what the handshake built, nil while it runs; the core reads none of it but
	// keeps it for the worker (remote, drops). peer and peerInc are the link's transfer agent.
	link     *remoteLink
	peer     string
	peerInc  uint64
	lastUsed time.Time
}

// handshaken reports whether r's handshake ended (a failed record is forgotten at once, so an
// ended record is a handshaken one).
func (r *remoteRecord) handshaken() bool { return r.link != nil }

// handshakeJob asks the worker for the side-channel handshake with a new record.
type handshakeJob struct {
	key  remoteKey
	addr string
}

// seconds is the engine's clock for the side channel and remote_blocks_expiry_time: seconds
// since the connector started.
func (k *core) seconds(now time.Time) float64 { return now.Sub(k.epoch).Seconds() }

// state returns the bookkeeping of seq, parsing its kv_transfer_params on first sight. Invalid
// or refused params are logged and ignored: the request computes locally (docs/architecture.md,
// wire contract item 8).
func (k *core) state(seq *engine.Sequence, now time.Time) *reqState {
	st := k.reqs[seq.ID()]
	if st != nil {
		return st
	}
	st = &reqState{}
	if raw := seq.KVTransfer(); raw != nil {
		p, err := ParseParams(raw)
		if err == nil {
			err = k.checkParams(p)
		}
		if err != nil {
			k.refuseParams(seq.ID(), err, now)
		} else {
			st.params = p
		}
	}
	k.reqs[seq.ID()] = st
	return st
}

// errRefusedParams wraps the reasons pull params are refused before any connection.
var errRefusedParams = errors.New("refused kv_transfer_params")

// errParamsMAC marks params refused for their MAC: most often engines with different auth
// tokens (counted apart, counters.paramsMAC).
var errParamsMAC = errors.New("auth token mismatch")

// checkParams refuses params that would make this engine pull KV (or notify a producer) unless
// they name a lease (its token and slot), the producer's instance and block generations, carry a
// valid MAC when engines share an auth token, and name an allowed host. Params that pull
// nothing (a first-turn template) pass.
func (k *core) checkParams(p *Params) error {
	if k.pushConsumer(p) && !k.peers.allows(p.RemoteHost) {
		return fmt.Errorf("%w: remote_host %q is not in kv_connector_extra_config.allowed_peers", errRefusedParams, clip(p.RemoteHost))
	}
	if pull, _ := k.consumer(p); !pull {
		return nil
	}
	switch {
	case !p.HasLease || p.LeaseSlot < 0:
		return fmt.Errorf("%w: they name no lease (%s, %s): only a kvbridge engine's params can be pulled from", errRefusedParams, KeyLease, KeyLeaseSlot)
	case p.Instance == "":
		return fmt.Errorf("%w: they name no producer instance (%s)", errRefusedParams, KeyInstance)
	case len(p.BlockGenerations) != len(p.Blocks()):
		return fmt.Errorf("%w: %d block generations for %d blocks", errRefusedParams, len(p.BlockGenerations), len(p.Blocks()))
	case k.paramsKey != nil && p.MAC == "":
		return fmt.Errorf("%w: %w: they carry no %s, so the engine that issued them has no auth token while this engine has one "+
			"(set the same kv_connector_extra_config.auth_token or %s on every engine, or none)", errRefusedParams, errParamsMAC, KeyMAC, EnvAuthToken)
	case k.paramsKey != nil && !verifyMAC(k.paramsKey, p):
		return fmt.Errorf("%w: %w: their %s does not verify: the auth token of the engine that issued these params differs from this engine's "+
			"(set the same kv_connector_extra_config.auth_token or %s on every engine), or they were forged", errRefusedParams, errParamsMAC, KeyMAC, EnvAuthToken)
	case !k.peers.allows(p.RemoteHost):
		return fmt.Errorf("%w: remote_host %q is not in kv_connector_extra_config.allowed_peers", errRefusedParams, clip(p.RemoteHost))
	}
	return nil
}

// refuseParams counts refused params and logs it, at most once per interval: a client can send
// as many as it likes.
func (k *core) refuseParams(id string, err error, now time.Time) {
	k.counts.params.Add(1)
	if errors.Is(err, errParamsMAC) {
		k.counts.paramsMAC.Add(1)
	}
	if ok, suppressed := k.quiet.allow("params", now); ok {
		k.log.Warn("Got invalid KVTransferParams; this request will not utilize KVTransfer", "request_id", id, "err", err, "similar_suppressed", suppressed)
	}
}

// consumer reports whether params ask this engine to pull the prompt's KV from a producer: a
// decode request carrying P's params, or (bidirectional) a prefill request carrying D's.
func (k *core) consumer(p *Params) (pull bool, fromDecoder bool) {
	switch {
	case p == nil || !p.Complete():
		return false, false
	case p.DoRemotePrefill:
		return true, false
	case p.DoRemoteDecode && k.cfg.Bidirectional:
		return true, true
	}
	return false, false
}

// arrived: a decode request that will pull from a producer starts heartbeating the producer's
// lease now, while it may still wait in the queue, and the handshake starts (vLLM's proactive
// handshake).
func (k *core) arrived(seq *engine.Sequence, now time.Time) {
	st := k.state(seq, now)
	if pull, fromD := k.consumer(st.params); pull && !fromD {
		k.track(st, now)
	}
	if k.pushConsumer(st.params) {
		k.pushArrived(st, now)
	}
}

// track starts heartbeats for a consumer request.
func (k *core) track(st *reqState, now time.Time) {
	if st.tracked || st.params.TPSize <= 0 {
		return // vLLM tracks only requests whose params carry tp_size
	}
	k.heartbeats.Track(heartbeatKey(st.params), st.params.Lease.String())
	st.tracked = true
	// vLLM's proactive handshake; the load waits for it.
	if r, err := k.entry(st.params, now); err == nil && !r.handshaken() {
		st.handshake, st.awaiting = handshakeJob{r.key, r.addr}, true
	}
}

// trackedParams returns the params of a request heart-beating the producer incarnation key
// (heartbeatKey), or nil; of the request with the least id when several do.
func (k *core) trackedParams(key string) *Params {
	for _, id := range slices.Sorted(maps.Keys(k.reqs)) {
		if st := k.reqs[id]; st.tracked && heartbeatKey(st.params) == key {
			return st.params
		}
	}
	return nil
}

// untrack stops heartbeats for a consumer request.
func (k *core) untrack(st *reqState) {
	if st.tracked {
		k.heartbeats.Untrack(heartbeatKey(st.params), st.params.Lease.String())
		st.tracked = false
	}
}

// heartbeatKey groups heartbeats by producer incarnation.
func heartbeatKey(p *Params) string { return p.RemoteEngineID + "\x00" + p.Instance }

// matchedExternal returns the tokens after the local hit that a producer holds, loaded
// asynchronously.
func (k *core) matchedExternal(seq *engine.Sequence, localHit int, now time.Time) (int, bool) {
	st := k.state(seq, now)
	pull, fromD := k.consumer(st.params)
	if k.pushConsumer(st.params) && !st.processed {
		pull = true // P pushes the whole prompt's KV; this engine registers what it lacks
	}
	if !pull || st.processed {
		return 0, false
	}
	avail := seq.NumPromptTokens()
	if fromD {
		st.pullFromD = true
		avail = k.verifiedTokens(st.params, seq.Prompt())
	} else if st.params.Complete() {
		k.track(st, now) // normally done on arrival; heartbeats never go towards a decoder
	}
	count := avail - localHit
	if count <= 0 {
		return 0, false
	}
	if t := k.cfg.threshold(); count < t {
		return 0, false // cheaper to recompute than to pull (kv_recompute_threshold)
	}
	return count, true
}

// verifiedTokens returns how many leading tokens of prompt a decoder's blocks hold, as far as
// the decoder's hash hints say: min(remote_num_tokens, prompt), cut at the first full block
// whose hint differs from the prompt's own chain. The hints only size the pull; what is read is
// checked against the decoder's published records (verify.go).
func (k *core) verifiedTokens(p *Params, prompt []int32) int {
	if p.BlockHashes == nil {
		return min(p.RemoteNumTokens, len(prompt))
	}
	n, cut := k.hintedPrefix(p, prompt)
	if cut {
		k.counts.rejections.Add(1)
	}
	return n
}

// hintedPrefix returns how many leading tokens of prompt, in whole blocks, match a decoder's
// hash hints, and whether a full block within min(remote_num_tokens, prompt) did not match.
func (k *core) hintedPrefix(p *Params, prompt []int32) (n int, cut bool) {
	bs := k.geo.BlockSize
	own := kvcache.ChainHashes(prompt[:min(p.RemoteNumTokens, len(prompt))], bs)
	ok := 0
	for ok < len(own) && ok < len(p.BlockHashes) && own[ok].String() == p.BlockHashes[ok] {
		ok++
	}
	// When every full block matched, the trailing partial block has no hint.
	return ok * bs, ok < len(own)
}

// release returns the notification that ends the lease p names, proving as much of the
// lease's prompt as prompt holds: a producer's whole prompt (remote_num_tokens), or of a
// decoder's hold (fromD) the whole blocks its hash hints confirm. A prompt that holds less
// proves nothing, and the owner keeps the lease: it ends only for the reader it was issued for.
func (k *core) release(p *Params, prompt []int32, fromD bool) []byte {
	n := 0
	switch {
	case fromD:
		n, _ = k.hintedPrefix(p, prompt)
	case len(prompt) >= p.RemoteNumTokens:
		n = p.RemoteNumTokens
	}
	return []byte(kvlease.FormatRelease(kvlease.Release{ID: p.RemoteRequestID, Readers: 1, Token: p.Lease, Proven: n, Proof: kvlease.Proof(p.Lease, prompt[:n])}))
}

// notifyFor asks the worker to tell the producer named by st's params that seq will not read
// its blocks.
func (k *core) notifyFor(st *reqState, seq *engine.Sequence) {
	_, fromD := k.consumer(st.params)
	k.out.notifies = append(k.out.notifies, notice{st.params, k.release(st.params, seq.Prompt(), fromD)})
}

// afterAlloc starts the load, or tells the producer to free when nothing is loaded.
func (k *core) afterAlloc(seq *engine.Sequence, blocks []int32, numExternal int, now time.Time) {
	st := k.state(seq, now)
	if k.pushConsumer(st.params) && !st.processed {
		k.pushAfterAlloc(st, seq, blocks, numExternal, now)
		return
	}
	pull, _ := k.consumer(st.params)
	if !pull || st.processed {
		return
	}
	st.processed = true
	if numExternal == 0 {
		k.untrack(st)
		k.notifyFor(st, seq)
		return
	}
	st.loading = true
	j := loadJob{
		id:       seq.ID(),
		params:   st.params,
		blocks:   append([]int32(nil), blocks...),
		prompt:   append([]int32(nil), seq.Prompt()...),
		localHit: seq.NumLocalHitTokens(),
		count:    numExternal,
		fromD:    st.pullFromD,
		release:  k.release(st.params, seq.Prompt(), st.pullFromD),

		handshake:    st.handshake,
		awaiting:     st.awaiting,
		handshakeErr: st.handshakeErr,
	}
	if k.closed {
		k.loadFinished(j, j.localHit/k.geo.BlockSize, transfer.ErrClosed, true, now)
		return
	}
	k.out.loads = append(k.out.loads, j)
}

// finished: a producer that finished normally holds its blocks for the reader and returns the
// params that name them; a consumer whose load is still running keeps its blocks until the load
// ends; a consumer that never loaded tells its producer to free.
func (k *core) finished(seq *engine.Sequence, status engine.Status, now time.Time) (bool, map[string]any) {
	st := k.reqs[seq.ID()]
	if st == nil {
		return false, nil
	}
	k.untrack(st)
	p := st.params
	pull, _ := k.consumer(p)
	if pull && !st.processed {
		k.notifyFor(st, seq) // aborted before its read: the producer must not wait for the lease
	}
	if k.pushConsumer(p) && !st.processed {
		k.pushCancel(st, seq) // ended before registering: the producer must not wait for the lease
	}
	if st.loading {
		// The load still writes into the blocks; they are released when it ends.
		st.finished = true
		return true, nil
	}
	delete(k.reqs, seq.ID())
	if p == nil || (status != engine.StatusFinishedStopped && status != engine.StatusFinishedLengthCapped) {
		if p != nil && p.DoRemoteDecode {
			k.pushAbandoned(p.PushID, "the prefill request was aborted or failed")
		}
		return false, nil // aborted or failed: free at once, no params (conformance item 7)
	}
	var params map[string]any
	switch {
	case p.DoRemoteDecode:
		params = k.holdForReader(seq, k.cfg.LeaseDuration, true, now)
		switch {
		case params != nil && k.cfg.Push():
			k.pushReady(seq, p.PushID, now)
		case params == nil:
			k.pushAbandoned(p.PushID, "the prefill's blocks could not be held")
		}
	case p.DoRemotePrefill && k.cfg.Bidirectional:
		params = k.holdForReader(seq, k.cfg.DecoderBlocksTTL, false, now)
	}
	return params != nil, params
}

// holdForReader leases seq's blocks for ttl under a fresh token, publishes what a reader checks
// (the blocks' records and the lease's tag in its slot) and returns the params that let a reader
// pull them. It returns nil, and holds nothing, when the blocks cannot be published.
func (k *core) holdForReader(seq *engine.Sequence, ttl time.Duration, renewable bool, now time.Time) map[string]any {
	blocks := append([]int32(nil), seq.Blocks()...)
	computed := seq.NumComputed()
	var token kvlease.Token
	if _, err := io.ReadFull(k.random, token[:]); err != nil {
		k.log.Error("drawing a lease token failed; the blocks are freed", "request_id", seq.ID(), "err", err)
		return nil
	}
	deadline := now.Add(ttl)
	l, replaced := k.leases.Add(seq.ID(), token, blocks, now, deadline, renewable) // the engine keeps a held id reserved
	if replaced != nil {
		k.clearSlot(replaced)
	}
	gens := k.pool.Generations(blocks)
	if l.Slot >= k.layout.NumBlocks {
		k.leases.Release(seq.ID())
		k.log.Error("no lease slot left; the blocks are freed", "request_id", seq.ID(), "leases", k.leases.Len())
		return nil
	}
	chain, err := k.pool.PublishChain(blocks, seq.Tokens()[:computed])
	if err != nil {
		k.leases.Release(seq.ID())
		k.log.Error("publishing the held blocks' records failed; the blocks are freed", "request_id", seq.ID(), "err", err)
		return nil
	}
	tag := kvlease.Tag(token, computed, blocks, gens)
	copy(k.slots[l.Slot*slotBytes:], tag[:])
	lengths := releaseLengths(computed, seq.NumPromptTokens(), k.geo.BlockSize, !renewable)
	l.Proofs = make(map[int][kvlease.ProofBytes]byte, len(lengths))
	for i, proof := range kvlease.Proofs(token, seq.Tokens()[:computed], lengths) {
		l.Proofs[lengths[i]] = proof
	}
	p := Params{
		DoRemotePrefill:  renewable, // P's params send D to pull; D's send the next P to pull
		DoRemoteDecode:   !renewable,
		RemoteBlockIDs:   [][]int32{blocks},
		RemoteEngineID:   k.engineID,
		RemoteRequestID:  seq.ID(),
		RemoteHost:       k.host,
		RemotePort:       k.port,
		TPSize:           k.pool.TensorParallelSize(),
		DCPSize:          1,
		PPSize:           1,
		RemoteNumTokens:  computed,
		TransferMode:     "pull",
		BlockGenerations: gens,
		Instance:         k.instance,
		Lease:            token,
		HasLease:         true,
		LeaseSlot:        l.Slot,
	}
	if renewable {
		p.TransferMode = k.cfg.TransferMode() // a decoder's holds are pulled, in push mode too
	}
	if !renewable {
		exp := k.seconds(deadline)
		p.RemoteBlocksExpiryTime = &exp
		// Hints for the next turn's prefiller, which sizes its pull with them before reading;
		// what it reads is checked against the records published above, not against these.
		p.BlockHashes = make([]string, len(chain))
		for i, h := range chain {
			p.BlockHashes[i] = h.String()
		}
	}
	if k.paramsKey != nil {
		p.MAC = paramsMAC(k.paramsKey, &p)
	}
	return p.Map()
}

// releaseLengths returns how many leading tokens of a lease's numTokens a release notification
// may prove (see core.release): a producer's lease, all of them — its reader decodes the same
// prompt; a decoder's hold (hold), any whole number of blocks from the last block boundary
// before the hold's prompt's last token (promptTokens; at least one block) up to numTokens, or
// numTokens — the next turn repeats the prompt, but the answer it appends may be tokenized
// otherwise than it was generated.
func releaseLengths(numTokens, promptTokens, blockSize int, hold bool) []int {
	if !hold {
		return []int{numTokens}
	}
	least := min(numTokens, max(blockSize, (promptTokens-1)/blockSize*blockSize))
	var out []int
	for n := (least + blockSize - 1) / blockSize * blockSize; n < numTokens; n += blockSize {
		out = append(out, n)
	}
	return append(out, numTokens)
}

// clearSlot withdraws l's tag: from now on no reader accepts what it reads under l. The lease's
// blocks must not be freed yet.
func (k *core) clearSlot(l *kvlease.Lease) {
	if l.Slot < k.layout.NumBlocks {
		clear(k.slots[l.Slot*slotBytes : (l.Slot+1)*slotBytes])
	}
}

// endLease withdraws l's tag and lets the engine free its blocks.
func (k *core) endLease(l *kvlease.Lease) {
	k.clearSlot(l)
	k.dropSource(l.RequestID)
	k.out.release = append(k.out.release, l.RequestID)
}

// evictHolds ends the oldest decoder holds until they add up to blocks blocks (or none is left),
// withdrawing their tags, and returns their request ids for the scheduler to free at once.
func (k *core) evictHolds(blocks int, now time.Time) []string {
	var ids []string
	for freed := 0; freed < blocks; {
		l := k.leases.EvictOldestHold()
		if l == nil {
			break
		}
		k.clearSlot(l)
		ids = append(ids, l.RequestID)
		freed += len(l.Blocks)
	}
	if len(ids) > 0 {
		k.counts.evictedHolds.Add(int64(len(ids)))
		if ok, suppressed := k.quiet.allow("evict", now); ok {
			k.log.Warn("KV pool full: evicting decoder holds kept for next turns (decoder_kv_blocks_ttl); those turns will recompute", "holds", len(ids), "blocks_wanted", blocks, "similar_suppressed", suppressed)
		}
	}
	return ids
}

// decline is told of params of a request refused before the engine took it. Without the
// request's prompt this engine cannot prove to the producer that it is the reader the lease was
// issued for (see release), so it sends nothing: the producer frees at lease expiry, as vLLM's
// does. Params that would be refused are still counted.
func (k *core) decline(raw map[string]any, now time.Time) {
	p, err := ParseParams(raw)
	if err != nil || p == nil {
		return
	}
	if pull, _ := k.consumer(p); !pull {
		return
	}
	if err := k.checkParams(p); err != nil {
		k.refuseParams(p.RemoteRequestID, err, now)
	}
}

// notification applies one notification from peer: "HB:token,…" extends leases; "<id>:<n>:
// <token>:<proven>:<proof>" is one of n reads of a lease done, by a reader that holds the
// lease's prompt. A release that presents no valid token, or no valid proof of the prompt,
// changes nothing; it is counted, and logged at most once per interval. Heartbeats need no
// proof: they only extend a lease (never shorten or end it), by 2/3 of kv_lease_duration past
// the last one, and a decoder sends them only while a request waits to read.
func (k *core) notification(peer, msg string, now time.Time) {
	if hexTokens, ok := kvlease.ParseHeartbeat(msg); ok {
		tokens := make([]kvlease.Token, 0, len(hexTokens))
		for _, h := range hexTokens {
			if t, err := kvlease.ParseToken(h); err == nil {
				tokens = append(tokens, t)
			}
		}
		k.leases.Heartbeat(tokens, now, k.cfg.LeaseDuration*2/3)
		return
	}
	r, err := kvlease.ParseRelease(msg)
	if err != nil {
		if ok, suppressed := k.quiet.allow("malformed", now); ok {
			k.log.Warn("ignoring a malformed KV notification", "peer", peer, "message", clip(msg), "err", err, "similar_suppressed", suppressed)
		}
		return
	}
	l, res := k.leases.Notify(r)
	if l != nil {
		k.endLease(l)
	}
	switch res {
	case kvlease.NotifyUnknown:
		// vLLM's every D rank notifies every P rank it read from: count them all.
		n := k.rankNotifications(peer, r.ReaderTP, true, now)
		k.countAfterExpiry(n)
		if ok, suppressed := k.quiet.allow("unknown", now); ok {
			k.log.Error(fmt.Sprintf("Potentially invalid KV blocks for unrecognized request %s were retrieved by a decode worker. They may have expired.", clip(r.ID)),
				"peer", peer, "rank_notifications", n, "similar_suppressed", suppressed)
		}
	case kvlease.NotifyRefused:
		k.counts.notifications.Add(1)
		if ok, suppressed := k.quiet.allow("refused", now); ok {
			k.log.Warn("refusing a KV notification that presents another lease's token", "request_id", clip(r.ID), "peer", peer, "similar_suppressed", suppressed)
		}
	case kvlease.NotifyUnproven:
		k.counts.notifications.Add(1)
		if ok, suppressed := k.quiet.allow("unproven", now); ok {
			k.log.Warn("refusing a KV notification that does not prove the prompt its lease was issued for (copied kv_transfer_params, or a request for another prompt); the lease is kept",
				"request_id", clip(r.ID), "peer", peer, "proven_tokens", r.Proven, "similar_suppressed", suppressed)
		}
	}
}

// tick releases expired leases (every entry, not only the earliest: vllm#58222), sends due
// heartbeats (asking for a new handshake with a producer whose record was dropped) and forgets
// remote engines idle longer than engine_ttl.
//
// A producer's lease that expires is a reader that never came: a WARN per request and
// vllm:nixl_num_kv_expired_reqs, as in vLLM. A bidirectional decoder's hold that expires is a
// cache entry that the conversation did not come back for (the client went away, or the next
// turn went to another decoder): it is counted in kvbridge:decoder_holds_expired_total and
// summed in one INFO line per quietInterval at most.
func (k *core) tick(now time.Time) {
	for _, l := range k.leases.Expire(now) {
		k.endLease(l)
		if !l.Renewable {
			k.holdsExpired++
			if k.metrics != nil {
				k.metrics.CountDecoderHoldExpired()
			}
			continue
		}
		k.log.Warn(fmt.Sprintf("Releasing expired KV blocks for request %s which were retrieved by %d remote worker(s) before lease expired.", l.RequestID, l.Notified()))
		if k.metrics != nil {
			k.metrics.CountExpiredRequest()
		}
	}
	k.expirePushes(now)
	if k.holdsExpired > 0 && (k.holdsSummarized.IsZero() || now.Sub(k.holdsSummarized) >= quietInterval) {
		k.out.holdsExpired = k.holdsExpired
		if !k.holdsSummarized.IsZero() {
			k.out.holdsSince = now.Sub(k.holdsSummarized)
		}
		k.holdsExpired, k.holdsSummarized = 0, now
	}
	for _, b := range k.heartbeats.Due(now) {
		engineID, instance, _ := strings.Cut(b.Engine, "\x00")
		r := k.remotes[remoteKey{engineID, instance}]
		if r == nil {
			// The record was dropped (its control link was lost, or it sat idle past
			// engine_ttl) while requests still wait to read from that producer: handshake
			// again, so that the next beat goes through instead of the leases lapsing until a
			// load re-handshakes. This beat is skipped.
			if p := k.trackedParams(b.Engine); p != nil {
				_, _ = k.entry(p, now)
			}
			continue
		}
		if r.handshaken() { // still handshaking: this beat is skipped, the next one goes through
			k.out.beats = append(k.out.beats, beat{r.peer, []byte(kvlease.FormatHeartbeat(b.IDs)), max(r.link.meta.TPSize, 1)})
		}
	}
	for _, r := range k.records() {
		if r.handshaken() && now.Sub(r.lastUsed) > k.cfg.EngineTTL {
			k.log.Info("forgetting an idle remote engine", "remote_engine_id", r.key.engine, "idle", now.Sub(r.lastUsed).String())
			k.drop(r)
		}
	}
}

// loadFinished reports a load to the engine: the blocks of a request that finished meanwhile
// are freed; a bidirectional pull whose decoder hold is gone is a miss (computed locally
// whatever the policy); other failures follow the policy.
//
// A decoder's hold is a cache that expires or is evicted by design, so a hold that is gone is
// neither a failed NIXL transfer nor a verification refusal: it is logged at debug level and
// counted nowhere (D counts its evictions). A producer's lease that is gone before its reader
// read (P→D) still is both: over SHM its slot is the only check of the params' lease token.
func (k *core) loadFinished(j loadJob, firstBad int, err error, quiet bool, now time.Time) {
	st := k.reqs[j.id]
	finished := st == nil || st.finished
	if st != nil {
		st.loading = false
		k.untrack(st)
		if st.finished {
			delete(k.reqs, j.id)
		}
	}
	holdGone := err != nil && j.fromD && (errors.Is(err, errLeaseGone) || errors.Is(err, transfer.ErrPermission))
	if holdGone && !quiet {
		k.log.Debug("the decoder's hold is gone (expired or evicted); computing the prompt here", "request_id", j.id,
			"remote_engine_id", j.params.RemoteEngineID, "remote_request_id", j.params.RemoteRequestID, "err", err)
	}
	if err != nil && !holdGone && !quiet {
		k.log.Error("NIXL transfer failure: transfer_failed", "request_id", j.id, "remote_engine_id", j.params.RemoteEngineID,
			"remote_request_id", j.params.RemoteRequestID, "remote_host", j.params.RemoteHost, "remote_port", j.params.RemotePort,
			"num_local_blocks", len(j.blocks), "num_remote_blocks", len(j.params.Blocks()), "err", err)
		if errors.Is(err, ErrVerification) {
			k.counts.verification.Add(1)
		}
		if k.metrics != nil && !errors.Is(err, ErrExpired) {
			k.metrics.CountFailedTransfer()
		}
	}
	switch {
	case finished:
		k.out.release = append(k.out.release, j.id)
	case holdGone:
		// A decoder's hold is a cache: one that expired or was evicted was not there to pull.
		// Nothing was used; the prompt is computed here, whatever the failure policy.
		k.out.missed = append(k.out.missed, j.id)
	case err != nil:
		if k.out.failed == nil {
			k.out.failed = map[string]int{}
		}
		k.out.failed[j.id] = firstBad
	default:
		k.out.loaded = append(k.out.loaded, j.id)
		if j.first != nil {
			if k.out.first == nil {
				k.out.first = map[string]engine.FirstToken{}
			}
			k.out.first[j.id] = *j.first
		}
	}
}

// expiredHold reports whether a bidirectional read of p's blocks must be declined: it would end
// within expiryMargin of the decoder's TTL, measured on this engine's clock through the
// handshake's clock offset (spec item 35). Params without an expiry never expire.
func (k *core) expiredHold(p *Params, offset float64, now time.Time) bool {
	if p.RemoteBlocksExpiryTime == nil {
		return false
	}
	deadline := *p.RemoteBlocksExpiryTime - offset // on our clock
	return k.seconds(now)+expiryMargin.Seconds() >= deadline
}

// records returns the remote records in the order of their keys, so that what the core decides
// about several of them comes out in an order that does not depend on map iteration.
func (k *core) records() []*remoteRecord {
	out := make([]*remoteRecord, 0, len(k.remotes))
	for _, key := range slices.SortedFunc(maps.Keys(k.remotes), func(a, b remoteKey) int {
		return cmp.Or(strings.Compare(a.engine, b.engine), strings.Compare(a.instance, b.instance))
	}) {
		out = append(out, k.remotes[key])
	}
	return out
}

// entry returns the record of the producer incarnation named by p, creating it (and asking for
// its handshake) if there is none. A known incarnation is used whatever address the params give
// (proxies rewrite remote_host); a new one is handshaken at the address given.
func (k *core) entry(p *Params, now time.Time) (*remoteRecord, error) {
	key := remoteKey{p.RemoteEngineID, p.Instance}
	r := k.remotes[key]
	if r == nil {
		if k.closed {
			return nil, transfer.ErrClosed
		}
		if k.handshaking >= maxHandshakes {
			return nil, fmt.Errorf("%w: %d handshakes already in progress", ErrHandshake, k.handshaking)
		}
		r = &remoteRecord{key: key, addr: joinHostPort(p.RemoteHost, p.RemotePort)}
		k.remotes[key] = r
		k.handshaking++
		k.out.handshakes = append(k.out.handshakes, handshakeJob{key: key, addr: r.addr})
	}
	r.lastUsed = now
	return r, nil
}

// handshakeEnded records the outcome of the handshake with the record key: the link it built,
// or the error it failed with. A failed record is forgotten so that the next request tries
// again, and the requests whose arrival found that handshake in progress fail with it.
func (k *core) handshakeEnded(key remoteKey, link *remoteLink, err error) {
	r := k.remotes[key]
	if r == nil || r.handshaken() {
		// No handshake of key was in progress (cannot happen: only its end removes a record
		// while it runs). Whatever it built is not kept.
		if link != nil {
			k.out.drops = append(k.out.drops, link)
		}
		return
	}
	k.handshaking--
	for _, st := range k.reqs {
		if st.awaiting && st.handshake.key == key {
			st.awaiting, st.handshakeErr = false, err
		}
	}
	if err != nil {
		delete(k.remotes, key)
		return
	}
	r.link, r.peer, r.peerInc = link, link.peer, link.peerInc
}

// forget drops the record of link's engine incarnation if link is still its link.
func (k *core) forget(link *remoteLink) {
	if r := k.remotes[link.key]; r != nil && r.link == link {
		k.drop(r)
	}
}

// drop removes r and asks the worker to forget its transfer peer.
func (k *core) drop(r *remoteRecord) {
	if k.remotes[r.key] == r {
		delete(k.remotes, r.key)
	}
	if r.handshaken() && r.peer != "" {
		k.out.drops = append(k.out.drops, r.link)
	}
}

// peerLost: the control connection to a producer's transfer agent ended. Its death is observed:
// its records are dropped now (which unmaps its arena), not when engine_ttl passes.
func (k *core) peerLost(name string, inc uint64, now time.Time) {
	for _, r := range k.records() {
		if r.handshaken() && r.peer == name && r.peerInc == inc {
			k.log.Info("a remote engine's transfer agent went away; forgetting it", "remote_engine_id", r.key.engine, "peer_addr", r.addr)
			k.drop(r)
		}
	}
	k.pushPeerLost(name, inc, now)
}

// older returns the links of the handshaken records of other incarnations of key's engine.
func (k *core) older(key remoteKey) []*remoteLink {
	var out []*remoteLink
	for _, o := range k.records() {
		if o.key != key && o.key.engine == key.engine && o.handshaken() {
			out = append(out, o.link)
		}
	}
	return out
}

// authorizeRead decides a TCP READ: it presents a lease token (the tag), and every range must lie
// inside the blocks leased under it, their records, or the lease's own slot.
func (k *core) authorizeRead(tag []byte, descs []transfer.Desc) error {
	var token kvlease.Token
	if len(tag) != len(token) {
		return errors.New("the READ presents no lease token (a reader must present the token of the lease whose blocks it reads)")
	}
	copy(token[:], tag)
	blockLen := int64(k.pool.BlockBytes())
	numBlocks := int64(k.pool.NumBlocks())
	l := k.leases.ByToken(token)
	if l == nil {
		return errors.New("no KV blocks are leased under the presented token (read already, expired, evicted, aborted, or never issued)")
	}
	for i, d := range descs {
		if d.Offset < 0 || d.Length <= 0 {
			return fmt.Errorf("range %d: invalid range [%d,+%d)", i, d.Offset, d.Length)
		}
		var unit int64
		switch d.Region {
		case k.kvRegion:
			unit = blockLen
		case k.metaRegion:
			unit = kvcache.RecordBytes
		default:
			if !slices.Contains(k.rankRegions, d.Region) {
				return fmt.Errorf("range %d: region %d holds no KV blocks", i, d.Region)
			}
			unit = blockLen
		}
		first, last := d.Offset/unit, (d.Offset+d.Length-1)/unit
		for b := first; b <= last; b++ {
			switch {
			case b < numBlocks && l.Holds(int32(b)):
			case d.Region == k.metaRegion && b == numBlocks+int64(l.Slot):
			default:
				return fmt.Errorf("range %d: entry %d is not part of the lease of request %q", i, b, clip(l.RequestID))
			}
		}
	}
	return nil
}
