package proxy

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"log"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
)

// A subscriber per event source: a ZMQ SUB socket dialled to an engine's (or one DP rank's)
// --kv-events-config endpoint, feeding the index. Messages are [topic, seq (8 bytes big-endian),
// payload] (docs/kv-events.md). The sequence decides (kvSeq, no I/O): the next one is applied;
// a gap is replayed from the engine's replay socket when one is configured, else the source is
// marked stale; a sequence that goes back (the engine restarted: a new incarnation starts at 0)
// resets the source first. A lost connection is dialled again, with backoff, until Close.

// kvSubTimeouts bound the subscriber's network calls.
const (
	kvDialTimeout   = 2 * time.Second
	kvReplayTimeout = 10 * time.Second
	kvMaxBackoff    = 2 * time.Second
	// Until the first live message, the replay socket is asked again after kvCatchUpFirst,
	// then at doubling intervals up to kvCatchUpMax.
	kvCatchUpFirst = 50 * time.Millisecond
	kvCatchUpMax   = 5 * time.Second
	// kvMaxReplay bounds the batches one replay may ask for; a larger gap marks the source stale.
	kvMaxReplay = 100_000
)

// kvSourceConfig is one event source: where it publishes, its replay socket ("" without) and
// the engine (prefiller position) it belongs to.
type kvSourceConfig struct {
	endpoint, replay string
	engine           int
}

// kvSeq is the sequence state machine of one source.
type kvSeq struct {
	next    uint64
	started bool
	// dupLo…dupHi were applied from a replay on connecting; the same batches arriving live
	// (published while the subscription took effect) are duplicates, until a later one comes.
	dupLo, dupHi uint64
	dups         bool
}

// kvSeqAction is what a batch's sequence number asks of the subscriber before the batch is
// applied.
type kvSeqAction struct {
	dup   bool   // already applied from a replay: skip it
	reset bool   // a new incarnation: empty the source first
	gap   bool   // batches [from, seq) were missed
	from  uint64 // the first missed batch
}

// replayed records that batches [from, next) were applied from a replay made while no live
// batch had come yet. Successive catch-ups replay successive ranges (each from the last one's
// next): the window grows to cover them all.
func (s *kvSeq) replayed(from, next uint64) {
	if next <= from {
		return
	}
	if !s.dups || from != s.dupHi+1 {
		s.dupLo = from
	}
	s.dupHi, s.dups = next-1, true
	s.started, s.next = true, max(s.next, next)
}

// observe returns what a live batch's seq asks for and advances the state past it.
func (s *kvSeq) observe(seq uint64) (a kvSeqAction) {
	if s.dups {
		if seq >= s.dupLo && seq <= s.dupHi {
			return kvSeqAction{dup: true}
		}
		s.dups = seq < s.dupLo // a restart's low sequence does not end the window; a later one does
	}
	switch {
	case !s.started:
		// The first batch seen: batches before it (if seq > 0) were published before we came.
		a = kvSeqAction{gap: seq > 0, from: 0}
	case seq == s.next:
	case seq > s.next:
		a = kvSeqAction{gap: true, from: s.next}
	default:
		// The sequence went back: the engine restarted (replayed batches never come here).
		a = kvSeqAction{reset: true, gap: seq > 0, from: 0}
	}
	s.started, s.next = true, seq+1
	return a
}

// kvSubscriber keeps one source of the index up to date.
type kvSubscriber struct {
	src   int
	cfg   kvSourceConfig
	topic string
	ix    *kvIndex
	log   *slog.Logger
	seq   kvSeq
	// lastSum is the fingerprint of the last batch applied, to recognise the engine on reconnecting.
	lastSum uint64
	// Counters for the metrics: batches and events applied, gaps seen, replays that applied
	// batches (a gap's, or what was published before the subscription took effect),
	// resets (new incarnations and AllBlocksCleared), malformed batches.
	batches, events, gaps, replayed, resets, malformed atomic.Uint64
	connected                                          atomic.Bool
}

// run subscribes until ctx ends.
func (s *kvSubscriber) run(ctx context.Context) {
	backoff := 50 * time.Millisecond
	for ctx.Err() == nil {
		err := s.session(ctx)
		s.connected.Store(false)
		if ctx.Err() != nil {
			return
		}
		s.log.Debug("KV events: subscription lost; dialling again", "endpoint", s.cfg.endpoint, "err", err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, kvMaxBackoff)
	}
}

// session dials the source once and applies its messages until the connection fails.
//
// A SUB socket's subscription takes effect at the publisher some time after the dial, and what
// is published before then is dropped. So until the first message arrives, the replay socket
// is asked again, with backoff, for what was published since: otherwise a batch that fell in
// that window would be missed until a later one showed the gap, and there may be none for a
// long while. Any message proves the subscription in effect, and ends the catch-up.
func (s *kvSubscriber) session(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	sock := zmq4.NewSub(ctx, zmq4.WithDialerTimeout(kvDialTimeout), zmq4.WithDialerMaxRetries(0), zmq4.WithLogger(discardLogger()))
	defer sock.Close()
	if err := sock.SetOption(zmq4.OptionSubscribe, s.topic); err != nil {
		return err
	}
	if err := sock.Dial(s.cfg.endpoint); err != nil {
		return err
	}
	s.connected.Store(true)
	s.resume(ctx)

	live := make(chan kvRecv)
	received := make(chan struct{})
	go func() { // exits when the socket's Recv fails, or ctx ends
		defer close(received)
		for {
			msg, err := sock.Recv()
			select {
			case live <- kvRecv{msg, err}:
			case <-ctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	defer func() { cancel(); <-received }() // cancel ends the socket's Recv (its context is ctx's child)

	// catchUp fires while no live message has come; nil without a replay socket, and after one.
	wait := kvCatchUpFirst
	var catchUp <-chan time.Time
	if s.cfg.replay != "" {
		catchUp = time.After(wait)
	}
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case r := <-live:
			if r.err != nil {
				return r.err
			}
			catchUp = nil
			s.receive(ctx, r.msg)
		case <-catchUp:
			s.catchUp(ctx)
			wait = min(2*wait, kvCatchUpMax)
			catchUp = time.After(wait)
		}
	}
}

// kvRecv is one Recv's result, handed from the socket's reader to the session.
type kvRecv struct {
	msg zmq4.Msg
	err error
}

// receive applies one live message: [topic, seq, payload].
func (s *kvSubscriber) receive(ctx context.Context, msg zmq4.Msg) {
	if len(msg.Frames) != 3 || len(msg.Frames[1]) != 8 {
		s.malformed.Add(1)
		s.log.Debug("KV events: a message that is not [topic, seq, payload]", "endpoint", s.cfg.endpoint, "frames", len(msg.Frames))
		return
	}
	s.handle(ctx, binary.BigEndian.Uint64(msg.Frames[1]), msg.Frames[2])
}

// resume runs when the subscriber (re)connects. After a lost connection it first tells whether
// the engine is the one it followed: the replay socket must still hold the last batch applied,
// byte for byte; a different batch, or none that far, is a new incarnation (it restarted), whose
// sequence may already have passed the old one's, and the source is reset. Then what was
// published before the subscription took effect (a PUB socket drops it) is replayed now, rather
// than when a later batch shows the gap: there may be none for a long while. Without a replay
// endpoint a reconnection cannot tell a restart from a network blip, and resets the source.
func (s *kvSubscriber) resume(ctx context.Context) {
	if s.cfg.replay == "" {
		if s.seq.started {
			s.restarted("reconnected without a replay endpoint")
		}
		return
	}
	if s.seq.started {
		same, err := s.sameIncarnation(ctx)
		switch {
		case err != nil:
			s.ix.setStale(s.src, true)
			s.log.Warn("KV events: reconnected, and the replay socket cannot tell whether the engine restarted; its index is stale", "endpoint", s.cfg.endpoint, "err", err)
		case !same:
			s.restarted("reconnected to a new incarnation")
		}
	}
	s.catchUp(ctx)
}

// catchUp applies what the replay socket keeps past the last batch applied: what was published
// before the subscription took effect.
func (s *kvSubscriber) catchUp(ctx context.Context) {
	from := s.seq.next
	next, err := s.replay(ctx, from, replayToEnd)
	s.seq.replayed(from, next)
	if next > from {
		s.replayed.Add(1)
	}
	if errors.Is(err, errLost) {
		s.ix.setStale(s.src, true)
		s.log.Warn("KV events: batches missed and no longer kept; routing uses this engine's index as it is (stale)", "endpoint", s.cfg.endpoint, "err", err)
	} else if err != nil {
		s.log.Debug("KV events: no replay of what came before the subscription", "endpoint", s.cfg.replay, "err", err)
	}
}

// restarted resets the source and the sequence: what comes next is all the engine holds.
func (s *kvSubscriber) restarted(why string) {
	s.log.Info("KV events: "+why+"; the engine's index entries are reset", "endpoint", s.cfg.endpoint)
	s.ix.reset(s.src)
	s.resets.Add(1)
	s.seq = kvSeq{}
}

// sameIncarnation asks the replay socket for the last batch applied and compares it.
func (s *kvSubscriber) sameIncarnation(ctx context.Context) (bool, error) {
	last := s.seq.next - 1
	sock, cancel, err := s.askReplay(ctx, last)
	if err != nil {
		return false, err
	}
	defer cancel()
	seq, payload, err := nextReply(sock)
	switch {
	case err != nil:
		return false, err
	case seq == ^uint64(0): // it keeps nothing from there: its newest batch is older
		return false, nil
	case seq > last:
		return false, fmt.Errorf("%w: batch %d (the last applied)", errLost, last)
	}
	return seq == last && fnv64(payload) == s.lastSum, nil
}

// handle applies one live batch, after what its sequence number asks for.
func (s *kvSubscriber) handle(ctx context.Context, seq uint64, payload []byte) {
	a := s.seq.observe(seq)
	if a.dup {
		return
	}
	if a.reset {
		s.log.Info("KV events: the engine's sequence started again (a new incarnation); its index entries are reset", "endpoint", s.cfg.endpoint, "seq", seq)
		s.ix.reset(s.src)
		s.resets.Add(1)
	}
	if a.gap {
		s.gaps.Add(1)
		if _, err := s.replay(ctx, a.from, seq); err != nil {
			s.ix.setStale(s.src, true)
			s.log.Warn("KV events: batches missed and not replayed; routing uses this engine's index as it is (stale) until the engine clears or restarts",
				"endpoint", s.cfg.endpoint, "from", a.from, "to", seq, "err", err)
		} else {
			s.replayed.Add(1)
		}
	}
	s.apply(payload)
}

// apply decodes a batch and applies its events to the index.
func (s *kvSubscriber) apply(payload []byte) {
	s.lastSum = fnv64(payload)
	b, err := decodeKVBatch(payload)
	if err != nil {
		s.malformed.Add(1)
		s.ix.setStale(s.src, true)
		s.log.Warn("KV events: a batch that does not decode; the engine's index is stale", "endpoint", s.cfg.endpoint, "err", err)
		return
	}
	for _, ev := range b.events {
		switch ev.kind {
		case kvBlockStored:
			s.ix.store(s.src, ev.hashes, ev.blockSize)
		case kvBlockRemoved:
			s.ix.remove(s.src, ev.hashes)
		case kvAllBlocksCleared:
			s.ix.reset(s.src)
			s.resets.Add(1)
		}
	}
	s.batches.Add(1)
	s.events.Add(uint64(len(b.events)))
}

// errNoReplay is replay's answer without a replay endpoint; errLost wraps its answer when the
// engine no longer keeps batches asked for.
var (
	errNoReplay = errors.New("no replay endpoint (--kv-events-replay)")
	errLost     = errors.New("batches no longer kept")
)

// replayToEnd asks replay for every batch the engine keeps from its start.
const replayToEnd = ^uint64(0)

// replay asks the source's replay socket for batches from `from` and applies them in order, up
// to until (exclusive) or, with replayToEnd, to the reply's end: a DEALER sends [empty, from]
// and reads [empty, seq, payload] until seq -1 (docs/kv-events.md). It returns the sequence
// number after the last batch applied. Batches the engine no longer keeps are errLost (with
// replayToEnd, those it does keep are still applied).
func (s *kvSubscriber) replay(ctx context.Context, from, until uint64) (uint64, error) {
	if s.cfg.replay == "" {
		return from, errNoReplay
	}
	if until != replayToEnd && until-from > kvMaxReplay {
		return from, fmt.Errorf("%w: %d batches missed, more than the %d a replay may ask for", errLost, until-from, kvMaxReplay)
	}
	sock, cancel, err := s.askReplay(ctx, from)
	if err != nil {
		return from, err
	}
	defer cancel()
	want := from
	var lost error
	for n := 0; until == replayToEnd || want < until; n++ {
		if n > kvMaxReplay {
			return want, fmt.Errorf("%w: the replay goes on beyond %d batches", errLost, kvMaxReplay)
		}
		seq, payload, err := nextReply(sock)
		if err != nil {
			return want, err
		}
		switch {
		case seq == ^uint64(0): // the end
			if until == replayToEnd {
				return want, lost
			}
			return want, fmt.Errorf("%w: the engine keeps none from %d", errLost, want)
		case seq < want:
			continue
		case seq > want:
			lost = fmt.Errorf("%w: batches %d to %d", errLost, want, seq-1)
			if until != replayToEnd {
				return want, lost
			}
		}
		s.apply(payload)
		want = seq + 1
	}
	return want, lost
}

// askReplay dials the replay socket and asks for the batches from `from`; the returned cancel
// closes the socket. The whole exchange is bounded by kvReplayTimeout.
func (s *kvSubscriber) askReplay(ctx context.Context, from uint64) (zmq4.Socket, func(), error) {
	ctx, cancelCtx := context.WithTimeout(ctx, kvReplayTimeout)
	sock := zmq4.NewDealer(ctx, zmq4.WithDialerTimeout(kvDialTimeout), zmq4.WithDialerMaxRetries(0), zmq4.WithLogger(discardLogger()))
	cancel := func() { sock.Close(); cancelCtx() }
	if err := sock.Dial(s.cfg.replay); err != nil {
		cancel()
		return nil, nil, err
	}
	if err := sock.Send(zmq4.NewMsgFrom([]byte{}, binary.BigEndian.AppendUint64(nil, from))); err != nil {
		cancel()
		return nil, nil, err
	}
	return sock, cancel, nil
}

// nextReply reads one replay reply: [empty, seq, payload] (seq -1 and an empty payload at the end).
func nextReply(sock zmq4.Socket) (uint64, []byte, error) {
	msg, err := sock.Recv()
	if err != nil {
		return 0, nil, fmt.Errorf("replay: %w", err)
	}
	f := msg.Frames
	if len(f) > 0 && len(f[0]) == 0 {
		f = f[1:] // the delimiter
	}
	if len(f) != 2 || len(f[0]) != 8 {
		return 0, nil, fmt.Errorf("replay: a reply of %d frames", len(f))
	}
	return binary.BigEndian.Uint64(f[0]), f[1], nil
}

// fnv64 is FNV-1a of b: a batch's fingerprint (its timestamp makes two batches differ).
func fnv64(b []byte) uint64 {
	h := fnv.New64a()
	_, _ = h.Write(b)
	return h.Sum64()
}

// discardLogger silences zmq4's own logger (failures reach the subscriber as errors).
func discardLogger() *log.Logger { return log.New(io.Discard, "", 0) }
