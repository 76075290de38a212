package connector

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvbridge/kvbridge/engine"
	"github.com/kvbridge/kvbridge/internal/msgpackcheck"
	"github.com/kvbridge/kvbridge/transfer"
)

// Push mode (kv_connector NixlPushConnector, vLLM's PR #35264): the decoder allocates blocks for
// the part of the prompt its prefix cache lacks and registers them with the prefiller over the
// authenticated transfer path ("PUSH_REG:" + msgpack, from the decoder's own agent); the
// prefiller matches the registration with its finished request, WRITEs the KV into those blocks
// and attaches a completion ("PUSH_DONE:" + msgpack) that the transfer engine delivers only
// once the data landed; the decoder checks the completion against its own prompt and decodes.
// This file is the core's side of it (pure: events in, actions out); pushworker.go runs the
// registrations and the writes.
//
// What each side holds, and for how long:
//   - P holds a finished request's blocks under its lease (kv_lease_duration) until a
//     registration comes and the write ends (the lease is stretched over the write); without
//     one the lease expires, counted as a pull's does (vllm:nixl_num_kv_expired_reqs).
//   - A registration that names a push_id whose request P has not finished yet is parked,
//     at most maxParkedRegistrations of them, each at most kv_lease_duration; one that names
//     a remote_request_id P does not hold is an "Unrecognized request"
//     (vllm:nixl_num_notifications_after_expiry) and is answered at once with a failure.
//   - D holds the registered blocks until the completion, a failure notice, the loss of P's
//     agent, or kv_lease_duration after the registration (counted as expired); the load then
//     ends and kv_load_failure_policy applies to a failure.
//
// Trust: P writes only into blocks named by a registration that came from the transfer agent
// of the engine it names (checked against that engine's handshake, pushworker.go), for a
// prompt equal to the request's own (the registration's digest and length), and only as many
// blocks as the request holds (tail-trimmed, vllm#48758); a second registration for the same
// request is refused. D accepts a completion only from the agent it registered with, echoing
// its registration's random nonce, for its own prompt's digest and length.

// The notification prefixes of push mode.
const (
	pushRegPrefix  = "PUSH_REG:"
	pushDonePrefix = "PUSH_DONE:"
)

// minPushLease is the least kv_lease_duration of push mode: a decoder's destination lease must
// outlast the margin within which a prefiller posts no write (expiryMargin), with room to write.
const minPushLease = 3 * expiryMargin

// maxParkedRegistrations bounds the registrations P keeps for push_ids whose request has not
// finished prefill yet.
const maxParkedRegistrations = 1024

// pushRegistration is D's registration of destination blocks with P.
type pushRegistration struct {
	// The registering engine: where P handshakes it (its side channel) and which incarnation.
	EngineID string `msgpack:"engine_id"`
	Instance string `msgpack:"instance"`
	Host     string `msgpack:"host"`
	Port     int    `msgpack:"port"`
	// RequestID is D's request, echoed in the completion.
	RequestID string `msgpack:"request_id"`
	// RemoteRequestID (the serial flow) or PushID (both legs at once) names P's request.
	RemoteRequestID string `msgpack:"remote_request_id,omitempty"`
	PushID          string `msgpack:"push_id,omitempty"`
	// Nonce is fresh per registration; the completion echoes it.
	Nonce []byte `msgpack:"nonce"`
	// FirstBlock is the index (in the prompt's blocks) of BlockIDs[0]; the blocks before it are
	// D's own prefix-cache hit. No blocks: D needs nothing (a full hit, or it gave up) and P
	// frees its blocks.
	FirstBlock int     `msgpack:"first_block"`
	BlockIDs   []int32 `msgpack:"block_ids"`
	// NumTokens and Digest describe D's prompt (promptDigest).
	NumTokens int    `msgpack:"num_tokens"`
	Digest    []byte `msgpack:"prompt_digest"`
	// Expiry is when D gives up on the write, on D's clock (seconds, as
	// remote_blocks_expiry_time); P rebases it through the handshake's clock offset.
	Expiry float64 `msgpack:"expiry"`
	// RemoteBlockSize is D's block size (vLLM's remote_block_size).
	RemoteBlockSize int    `msgpack:"remote_block_size"`
	TransferMode    string `msgpack:"transfer_mode"`
	// FirstToken asks P to send, with the completion, the token it sampled for its answer, so
	// that D computes no prompt position (D registered blocks for the whole prompt, the last
	// position's included); Fingerprint is D's engine.Request.FirstTokenFingerprint, for P to
	// echo its own beside the token. A producer that does not know these keys sends no token,
	// and D computes its last prompt position as before.
	FirstToken  bool   `msgpack:"first_token,omitempty"`
	Fingerprint []byte `msgpack:"sampling_fingerprint,omitempty"`
}

// pushCompletion ends one registration: the write landed (Error empty), or it will not come.
type pushCompletion struct {
	RequestID string `msgpack:"request_id"`
	Nonce     []byte `msgpack:"nonce"`
	NumTokens int    `msgpack:"num_tokens"`
	Digest    []byte `msgpack:"prompt_digest"`
	Error     string `msgpack:"error,omitempty"`
	// Token is the first token P sampled from the prompt (sent when the registration asked
	// for it), Draws how many random numbers P's sampler drew for it (0 greedy, 1 otherwise),
	// Fingerprint P's engine.Request.FirstTokenFingerprint. D uses the token only when the
	// fingerprints are equal; a token outside D's vocabulary or another draw count is a bad
	// completion.
	Token       *int32 `msgpack:"first_token,omitempty"`
	Draws       int    `msgpack:"first_token_draws,omitempty"`
	Fingerprint []byte `msgpack:"sampling_fingerprint,omitempty"`
}

// sampledFirst is what P sampled for a request's first token (pushCompletion's Token, Draws
// and Fingerprint).
type sampledFirst struct {
	token       int32
	draws       int
	fingerprint []byte
}

// promptDigest is the SHA-256 of tokens (little-endian int32s): what P and D compare before a
// write is posted and before written KV is used.
func promptDigest(tokens []int32) []byte {
	h := sha256.New()
	var b [4]byte
	for _, t := range tokens {
		binary.LittleEndian.PutUint32(b[:], uint32(t))
		h.Write(b[:])
	}
	return h.Sum(nil)
}

// encodePush renders a push message with its prefix.
func encodePush(prefix string, v any) []byte {
	data, err := msgpack.Marshal(v)
	if err != nil {
		panic(err) // plain structs of strings, ints and byte slices always encode
	}
	return append([]byte(prefix), data...)
}

// decodePush parses the msgpack body of a push message from a peer (untrusted).
func decodePush(body string, v any) error {
	b := []byte(body)
	n, err := msgpackcheck.Check(b, 4)
	if err == nil && n != len(b) {
		err = fmt.Errorf("%d trailing bytes", len(b)-n)
	}
	if err == nil {
		err = msgpack.NewDecoder(bytes.NewReader(b)).Decode(v)
	}
	return err
}

// check refuses registrations no decoder sends.
func (r *pushRegistration) check(maxBlocks int) error {
	switch {
	case r.RequestID == "" || len(r.RequestID) > 512:
		return errors.New("no request_id")
	case r.RemoteRequestID == "" && r.PushID == "":
		return errors.New("names neither remote_request_id nor push_id")
	case len(r.PushID) > maxPushIDBytes || len(r.RemoteRequestID) > 512:
		return errors.New("an id is too long")
	case r.EngineID == "" || r.Host == "" || r.Port <= 0 || r.Port > 65535:
		return errors.New("names no engine, host and port")
	case len(r.Nonce) != 16 || len(r.Digest) != sha256.Size:
		return errors.New("a nonce of 16 bytes and a digest of 32 are required")
	case r.FirstBlock < 0 || r.NumTokens <= 0 || len(r.BlockIDs) > maxBlocks:
		return errors.New("block range out of bounds")
	case len(r.Fingerprint) != 0 && len(r.Fingerprint) != sha256.Size:
		return errors.New("a sampling fingerprint of 32 bytes is required")
	}
	seen := make(map[int32]struct{}, len(r.BlockIDs))
	for _, b := range r.BlockIDs {
		if _, dup := seen[b]; dup || b < 0 {
			return fmt.Errorf("block %d named twice or negative", b)
		}
		seen[b] = struct{}{}
	}
	return nil
}

// pushSource is P's finished request waiting for, or under, a push.
type pushSource struct {
	id        string
	pushID    string
	blocks    []int32
	numTokens int
	digest    []byte
	first     *sampledFirst // the request's first output token, if it has one
	claimed   bool          // a registration was accepted: no other is
}

// parkedRegistration is a registration that named a push_id before its request finished.
type parkedRegistration struct {
	peer    string
	peerInc uint64
	reg     pushRegistration
	at      time.Time
}

// pushDest is D's request waiting for a push into its blocks.
type pushDest struct {
	nonce    []byte
	deadline time.Time
	peer     string // the producer's agent, once the registration was sent
	peerInc  uint64
	job      loadJob
	digest   []byte
	blocks   map[int32]struct{} // the registered blocks: the only ones the producer may write
	// fingerprint is the request's engine.Request.FirstTokenFingerprint when the registration
	// asked for the producer's first token; nil when it did not.
	fingerprint []byte
}

// pushState is the core's push bookkeeping.
type pushState struct {
	sources  map[string]*pushSource // P: by request id
	byPushID map[string]string      // P: push_id → request id
	parked   map[string]parkedRegistration
}

// newPushState returns empty push bookkeeping.
func newPushState() pushState {
	return pushState{sources: map[string]*pushSource{}, byPushID: map[string]string{}, parked: map[string]parkedRegistration{}}
}

// registerJob asks the worker to send a registration to the producer named by params.
type registerJob struct {
	id     string
	params *Params
	msg    []byte
	nonce  []byte
	cancel bool // no blocks: only tells the producer to free

	handshake    handshakeJob
	awaiting     bool
	handshakeErr error
}

// pushJob asks the worker to WRITE a finished request's KV into a decoder's registered blocks.
type pushJob struct {
	id        string
	peer      string // the agent the registration came from, and its incarnation
	peerInc   uint64
	reg       pushRegistration
	blocks    []int32 // the request's blocks on this engine
	numTokens int
	digest    []byte
	first     *sampledFirst
}

// completion returns the completion of j's write: the prompt it wrote and, if the
// registration asked for it, the first token this engine sampled.
func (j pushJob) completion() []byte {
	done := pushCompletion{RequestID: j.reg.RequestID, Nonce: j.reg.Nonce, NumTokens: j.numTokens, Digest: j.digest}
	if j.reg.FirstToken && j.first != nil {
		tok := j.first.token
		done.Token, done.Draws, done.Fingerprint = &tok, j.first.draws, j.first.fingerprint
	}
	return encodePush(pushDonePrefix, done)
}

// pushNotice is a failure completion to send to a decoder's agent at once.
type pushNotice struct {
	peer string
	msg  []byte
}

// pushConsumer reports whether p asks this (push) engine to register its blocks with a producer.
func (k *core) pushConsumer(p *Params) bool { return k.cfg.Push() && p.PushComplete() }

// pushArrived starts the handshake with the producer as soon as a push request arrives (vLLM's
// proactive handshake): the registration waits for it.
func (k *core) pushArrived(st *reqState, now time.Time) {
	if r, err := k.entry(st.params, now); err == nil && !r.handshaken() {
		st.handshake, st.awaiting = handshakeJob{r.key, r.addr}, true
	} else if err != nil {
		st.handshakeErr = err
	}
}

// pushAfterAlloc registers the request's blocks past its local hit with the producer, or tells
// the producer to free when nothing is needed.
func (k *core) pushAfterAlloc(st *reqState, seq *engine.Sequence, blocks []int32, numExternal int, now time.Time) {
	st.processed = true
	if numExternal == 0 {
		k.pushCancel(st, seq)
		return
	}
	bs := k.geo.BlockSize
	localHit := seq.NumLocalHitTokens()
	first, last := localHit/bs, (localHit+numExternal+bs-1)/bs-1
	j := loadJob{
		id: seq.ID(), params: st.params, blocks: append([]int32(nil), blocks...), prompt: append([]int32(nil), seq.Prompt()...),
		localHit: localHit, count: numExternal,
	}
	nonce := make([]byte, 16)
	if _, err := io.ReadFull(k.random, nonce); err != nil || last >= len(blocks) {
		k.loadFinished(j, first, fmt.Errorf("push registration of request %s: %d blocks for %d tokens, or no nonce (%v)", seq.ID(), len(blocks), localHit+numExternal, err), false, now)
		return
	}
	deadline := now.Add(k.cfg.LeaseDuration)
	d := &pushDest{nonce: nonce, deadline: deadline, job: j, digest: promptDigest(seq.Prompt()), blocks: map[int32]struct{}{}}
	if r := seq.Request(); k.vocab > 0 && localHit+numExternal >= seq.NumPromptTokens() && r.CanTakeFirstToken() {
		d.fingerprint = r.FirstTokenFingerprint()
	}
	reg := k.registration(st.params, seq, d)
	reg.FirstToken, reg.Fingerprint = d.fingerprint != nil, d.fingerprint
	reg.FirstBlock, reg.BlockIDs, reg.Expiry = first, append([]int32(nil), blocks[first:last+1]...), k.seconds(deadline)
	for _, b := range reg.BlockIDs {
		d.blocks[b] = struct{}{}
	}
	st.loading, st.push = true, d
	if k.closed {
		k.finishPush(st, first, errors.New("the connector is closing"), true, now)
		return
	}
	k.out.registers = append(k.out.registers, registerJob{id: seq.ID(), params: st.params, msg: encodePush(pushRegPrefix, reg), nonce: nonce,
		handshake: st.handshake, awaiting: st.awaiting, handshakeErr: st.handshakeErr})
}

// registration returns the fields of a registration of seq common to every kind.
func (k *core) registration(p *Params, seq *engine.Sequence, d *pushDest) pushRegistration {
	reg := pushRegistration{
		EngineID: k.engineID, Instance: k.instance, Host: k.host, Port: k.port, RequestID: seq.ID(),
		PushID: p.PushID, NumTokens: seq.NumPromptTokens(), Expiry: k.seconds(d.deadline),
		RemoteBlockSize: k.geo.BlockSize, TransferMode: "push", Nonce: d.nonce, Digest: d.digest,
	}
	if p.PushID == "" {
		reg.RemoteRequestID = p.RemoteRequestID
	}
	return reg
}

// pushCancel tells the producer that this engine needs none of its blocks (a full prefix hit, or
// the request ended before registering): a registration with no blocks, for this prompt.
func (k *core) pushCancel(st *reqState, seq *engine.Sequence) {
	d := &pushDest{nonce: make([]byte, 16), digest: promptDigest(seq.Prompt())}
	_, _ = io.ReadFull(k.random, d.nonce)
	reg := k.registration(st.params, seq, d)
	k.out.registers = append(k.out.registers, registerJob{id: seq.ID(), params: st.params, msg: encodePush(pushRegPrefix, reg), cancel: true,
		handshake: st.handshake, awaiting: st.awaiting, handshakeErr: st.handshakeErr})
}

// pushRegistered records the producer's agent a registration was sent to; it reports whether the
// request still waits for that push (it may have expired or failed meanwhile).
func (k *core) pushRegistered(id string, nonce []byte, peer string, inc uint64) bool {
	st := k.reqs[id]
	if st == nil || st.push == nil || !bytes.Equal(st.push.nonce, nonce) {
		return false
	}
	st.push.peer, st.push.peerInc = peer, inc
	return true
}

// pushFailed ends a request's wait for a push with err, if it still waits for that registration.
func (k *core) pushFailed(id string, nonce []byte, err error, now time.Time) {
	st := k.reqs[id]
	if st == nil || st.push == nil || !bytes.Equal(st.push.nonce, nonce) {
		return
	}
	k.finishPush(st, st.push.job.localHit/k.geo.BlockSize, err, false, now)
}

// finishPush ends st's wait for a push and reports it as a load.
func (k *core) finishPush(st *reqState, firstBad int, err error, quiet bool, now time.Time) {
	j := st.push.job
	st.push = nil
	k.loadFinished(j, firstBad, err, quiet, now)
}

// pushCompleted applies a completion from peer: the write into a request's blocks landed, or it
// will not come. Only the agent the registration went to, echoing its nonce, can end it; a
// successful one must describe this request's prompt.
func (k *core) pushCompleted(peer, body string, now time.Time) {
	var done pushCompletion
	if err := decodePush(body, &done); err != nil {
		k.malformed(peer, pushDonePrefix+body, err, now)
		return
	}
	st := k.reqs[done.RequestID]
	if st == nil || st.push == nil || !bytes.Equal(st.push.nonce, done.Nonce) {
		// vLLM's every P rank notifies every D rank it wrote: count them all.
		n := k.rankNotifications(peer, 0, false, now)
		k.countAfterExpiry(n)
		if ok, suppressed := k.quiet.allow("unknown", now); ok {
			k.log.Error(fmt.Sprintf("Unrecognized request %s in a KV push completion: the receive already completed or was abandoned (expired, failed or aborted).", clip(done.RequestID)),
				"peer", peer, "rank_notifications", n, "similar_suppressed", suppressed)
		}
		return
	}
	d := st.push
	if d.peer != peer {
		k.counts.notifications.Add(1)
		if ok, suppressed := k.quiet.allow("refused", now); ok {
			k.log.Warn("refusing a KV push completion from an agent the registration did not go to", "request_id", clip(done.RequestID), "peer", peer, "similar_suppressed", suppressed)
		}
		return
	}
	first := d.job.localHit / k.geo.BlockSize
	switch {
	case done.Error != "":
		k.finishPush(st, first, fmt.Errorf("the producer did not push request %s's KV: %s", st.push.job.id, clip(done.Error)), false, now)
	case done.NumTokens != len(d.job.prompt) || !bytes.Equal(done.Digest, d.digest):
		k.finishPush(st, first, fmt.Errorf("%w: request %s: the producer pushed KV of %d tokens of another prompt", ErrVerification, d.job.id, done.NumTokens), false, now)
	case d.fingerprint != nil && done.Token != nil && (*done.Token < 0 || int(*done.Token) >= k.vocab || done.Draws < 0 || done.Draws > 1):
		k.finishPush(st, first, fmt.Errorf("%w: request %s: the producer's first token %d (%d draws) is not one this engine could sample", ErrVerification, d.job.id, *done.Token, done.Draws), false, now)
	default:
		if d.fingerprint != nil && done.Token != nil && bytes.Equal(done.Fingerprint, d.fingerprint) {
			d.job.first = &engine.FirstToken{Token: *done.Token, Draws: done.Draws}
		}
		k.finishPush(st, 0, nil, false, now)
	}
}

// expirePushes fails the pushes whose destination lease passed (D), and drops the parked
// registrations older than kv_lease_duration (P), telling their decoders at once.
func (k *core) expirePushes(now time.Time) {
	for _, id := range slices.Sorted(maps.Keys(k.reqs)) {
		st := k.reqs[id]
		if st.push == nil || now.Before(st.push.deadline) {
			continue
		}
		k.log.Warn(fmt.Sprintf("Releasing the KV blocks request %s registered for a push: no completion within kv_lease_duration (%s).", id, k.cfg.LeaseDuration))
		if k.metrics != nil {
			k.metrics.CountExpiredRequest()
		}
		k.finishPush(st, st.push.job.localHit/k.geo.BlockSize, fmt.Errorf("%w: request %s: no push completion within kv_lease_duration", ErrExpired, id), true, now)
	}
	for _, pid := range slices.Sorted(maps.Keys(k.push.parked)) {
		pr := k.push.parked[pid]
		if now.Sub(pr.at) < k.cfg.LeaseDuration {
			continue
		}
		delete(k.push.parked, pid)
		k.refusePush(pr.peer, pr.reg, "no request with this push_id finished prefill on this engine within kv_lease_duration")
		k.countAfterExpiry(k.rankNotifications(pr.peer, 0, true, now))
		if ok, suppressed := k.quiet.allow("unknown", now); ok {
			k.log.Error(fmt.Sprintf("Unrecognized request with push_id %s: a decoder registered blocks for it and no such request finished prefill within kv_lease_duration.", clip(pid)),
				"peer", pr.peer, "similar_suppressed", suppressed)
		}
	}
}

// pushPeerLost fails at once the pushes awaited from an agent that went away.
func (k *core) pushPeerLost(name string, inc uint64, now time.Time) {
	for _, id := range slices.Sorted(maps.Keys(k.reqs)) {
		st := k.reqs[id]
		if st.push != nil && st.push.peer == name && st.push.peerInc == inc {
			k.finishPush(st, st.push.job.localHit/k.geo.BlockSize, fmt.Errorf("the producer's transfer agent %s went away before pushing request %s's KV", name, id), false, now)
		}
	}
}

// pushReady makes a finished request's held blocks (already leased) available to push, and
// starts the push at once when its registration was parked.
func (k *core) pushReady(seq *engine.Sequence, pushID string, now time.Time) {
	computed := seq.NumComputed()
	src := &pushSource{id: seq.ID(), pushID: pushID, blocks: append([]int32(nil), seq.Blocks()...), numTokens: computed, digest: promptDigest(seq.Tokens()[:computed])}
	if out := seq.Output(); len(out) > 0 {
		src.first = &sampledFirst{token: out[0], draws: seq.FirstTokenDraws(), fingerprint: seq.Request().FirstTokenFingerprint()}
	}
	k.push.sources[src.id] = src
	if pushID == "" {
		return
	}
	k.push.byPushID[pushID] = src.id
	if pr, ok := k.push.parked[pushID]; ok {
		delete(k.push.parked, pushID)
		k.claim(src, pr.peer, pr.peerInc, pr.reg, now)
	}
}

// pushAbandoned tells the decoder whose registration for pushID is parked that the request
// ended without KV to push, so that it applies its failure policy at once.
func (k *core) pushAbandoned(pushID, why string) {
	if pr, ok := k.push.parked[pushID]; ok && pushID != "" {
		delete(k.push.parked, pushID)
		k.refusePush(pr.peer, pr.reg, why)
	}
}

// dropSource forgets a request's push source when its lease ends.
func (k *core) dropSource(id string) {
	if src := k.push.sources[id]; src != nil {
		delete(k.push.sources, id)
		if k.push.byPushID[src.pushID] == id {
			delete(k.push.byPushID, src.pushID)
		}
	}
}

// registered applies a registration from the agent peer, incarnation inc (P).
func (k *core) registered(peer string, inc uint64, body string, now time.Time) {
	var reg pushRegistration
	err := decodePush(body, &reg)
	if err == nil {
		err = reg.check(maxRemoteBlocks)
	}
	if err == nil && !k.peers.allows(reg.Host) {
		err = fmt.Errorf("host %q is not in kv_connector_extra_config.allowed_peers", clip(reg.Host))
	}
	if err == nil && !k.cfg.Push() {
		err = errors.New("this engine runs pull mode (kv_connector NixlConnector)")
	}
	if err != nil {
		k.malformed(peer, pushRegPrefix+body, err, now)
		return
	}
	id := reg.RemoteRequestID
	if id == "" {
		id = k.push.byPushID[reg.PushID]
	}
	src := k.push.sources[id]
	switch {
	case src != nil:
		k.claim(src, peer, inc, reg, now)
	case reg.RemoteRequestID == "" && len(reg.BlockIDs) > 0:
		// Both legs at once: the request may not have finished prefill yet (or not arrived).
		if _, dup := k.push.parked[reg.PushID]; dup || len(k.push.parked) >= maxParkedRegistrations {
			k.counts.notifications.Add(1)
			k.refusePush(peer, reg, "registration refused: another one for this push_id is waiting, or too many are")
			return
		}
		k.push.parked[reg.PushID] = parkedRegistration{peer: peer, peerInc: inc, reg: reg, at: now}
	case len(reg.BlockIDs) == 0:
		// A cancel for a request this engine does not hold: nothing to free.
	default:
		k.countAfterExpiry(k.rankNotifications(peer, 0, true, now))
		if ok, suppressed := k.quiet.allow("unknown", now); ok {
			k.log.Error(fmt.Sprintf("Unrecognized request %s in a KV push registration: its blocks are no longer held (the lease expired, or the request never finished here).", clip(reg.RemoteRequestID)),
				"peer", peer, "similar_suppressed", suppressed)
		}
		k.refusePush(peer, reg, "unrecognized request: its KV is no longer held")
	}
}

// claim matches a registration with a held request: a cancel for the same prompt frees the
// blocks; a registration for the same prompt starts the write, stretching the lease over it.
// Anything else is refused and the blocks are kept for the right reader.
func (k *core) claim(src *pushSource, peer string, inc uint64, reg pushRegistration, now time.Time) {
	l := k.leases.Get(src.id)
	known := k.remotes[remoteKey{reg.EngineID, reg.Instance}]
	switch {
	case known != nil && known.handshaken() && (known.peer != peer || known.peerInc != inc):
		// Only the engine that owns the blocks may name them (the worker checks it again
		// after a handshake, for an engine not handshaken yet).
		k.counts.notifications.Add(1)
		if ok, suppressed := k.quiet.allow("refused", now); ok {
			k.log.Warn("refusing a KV push registration naming blocks of an engine whose transfer agent did not send it; the blocks are kept",
				"request_id", clip(src.id), "peer", peer, "named_engine", clip(reg.EngineID), "similar_suppressed", suppressed)
		}
		k.refusePush(peer, reg, "the registration did not come from the engine it names")
		return
	case l == nil:
		k.refusePush(peer, reg, "unrecognized request: its KV is no longer held")
		return
	case src.claimed:
		k.counts.notifications.Add(1)
		k.refusePush(peer, reg, "another decoder already registered for this request")
		return
	case reg.NumTokens != src.numTokens || !bytes.Equal(reg.Digest, src.digest):
		k.counts.notifications.Add(1)
		if ok, suppressed := k.quiet.allow("unproven", now); ok {
			k.log.Warn("refusing a KV push registration for another prompt than the request's (copied kv_transfer_params, or another prompt); the blocks are kept",
				"request_id", clip(src.id), "peer", peer, "similar_suppressed", suppressed)
		}
		k.refusePush(peer, reg, "the registration's prompt is not the request's")
		return
	case len(reg.BlockIDs) == 0:
		k.endLease(k.leases.Release(src.id))
		return
	}
	src.claimed = true
	if d := now.Add(loadTimeout + expiryMargin); d.After(l.Deadline) {
		l.Deadline = d // the blocks stay held while the write reads them; pushEnded frees them
	}
	k.out.pushes = append(k.out.pushes, pushJob{id: src.id, peer: peer, peerInc: inc, reg: reg, blocks: src.blocks, numTokens: src.numTokens, digest: src.digest, first: src.first})
}

// refusePush answers a registration with a failure completion, so that its decoder applies its
// failure policy at once instead of waiting for its lease.
func (k *core) refusePush(peer string, reg pushRegistration, why string) {
	if len(reg.BlockIDs) == 0 {
		return // a cancel waits for nothing
	}
	k.out.pushNotices = append(k.out.pushNotices, pushNotice{peer: peer, msg: encodePush(pushDonePrefix, pushCompletion{RequestID: reg.RequestID, Nonce: reg.Nonce, Error: why})})
}

// pushEnded: the write of request id ended; its lease ends and the blocks are freed. With
// wrongSender nothing was written: the registration did not come from the engine it names, so
// the request keeps its blocks for its real decoder, under its lease.
func (k *core) pushEnded(id string, wrongSender bool) {
	if wrongSender {
		k.counts.notifications.Add(1)
		if src := k.push.sources[id]; src != nil {
			src.claimed = false
		}
		return
	}
	if l := k.leases.Release(id); l != nil {
		k.endLease(l)
	}
}

// closePushes fails every push this engine still waits for: the connector is closing and no
// completion will be read.
func (k *core) closePushes(now time.Time) {
	for _, id := range slices.Sorted(maps.Keys(k.reqs)) {
		if st := k.reqs[id]; st.push != nil {
			k.finishPush(st, st.push.job.localHit/k.geo.BlockSize, fmt.Errorf("request %s: %w", id, errors.New("the connector closed before the push completed")), true, now)
		}
	}
}

// malformed logs a notification that does not parse, at most once per interval.
func (k *core) malformed(peer, msg string, err error, now time.Time) {
	if ok, suppressed := k.quiet.allow("malformed", now); ok {
		k.log.Warn("ignoring a malformed KV notification", "peer", peer, "message", clip(msg), "err", err, "similar_suppressed", suppressed)
	}
}

// pushMessage applies a push notification from the agent peer, incarnation inc; it reports
// whether msg was one.
func (k *core) pushMessage(peer string, inc uint64, msg string, now time.Time) bool {
	if body, ok := strings.CutPrefix(msg, pushRegPrefix); ok {
		k.registered(peer, inc, body, now)
		return true
	}
	if body, ok := strings.CutPrefix(msg, pushDonePrefix); ok {
		k.pushCompleted(peer, body, now)
		return true
	}
	return false
}

// pushTail returns the pairs (local block, remote block) a push writes: the request's blocks
// from the registration's first block on, as many as both hold (P tail-trims what D registered
// beyond its computed tokens, vllm#48758).
func pushTail(j pushJob, blockSize int) (local, remote []int) {
	n := (j.numTokens + blockSize - 1) / blockSize
	for i, b := range j.reg.BlockIDs {
		k := j.reg.FirstBlock + i
		if k >= n || k >= len(j.blocks) {
			break
		}
		local = append(local, int(j.blocks[k]))
		remote = append(remote, int(b))
	}
	return local, remote
}

// authorizeWrite decides a TCP WRITE into this engine (D): every range must lie inside blocks a
// request registered with the writing agent and still waits for.
func (k *core) authorizeWrite(peer string, descs []transfer.Desc) error {
	blockLen := int64(k.pool.BlockBytes())
	for i, d := range descs {
		if (d.Region != k.kvRegion && !slices.Contains(k.rankRegions, d.Region)) || d.Offset < 0 || d.Length <= 0 {
			return fmt.Errorf("range %d: not KV blocks", i)
		}
		for b := d.Offset / blockLen; b <= (d.Offset+d.Length-1)/blockLen; b++ {
			if !k.registeredWith(peer, int32(b)) {
				return fmt.Errorf("range %d: block %d is not registered with agent %s for a push", i, b, clip(peer))
			}
		}
	}
	return nil
}

// registeredWith reports whether a request waiting for a push from the agent peer registered block.
func (k *core) registeredWith(peer string, block int32) bool {
	for _, st := range k.reqs {
		if d := st.push; d != nil && d.peer == peer {
			if _, ok := d.blocks[block]; ok {
				return true
			}
		}
	}
	return false
}
