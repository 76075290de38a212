package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvbridge/kvbridge/kvcache"
)

// Options configures a Publisher.
type Options struct {
	// Config is the (rank's: Config.ForRank) --kv-events-config; it must be Active.
	Config Config
	// Rank is the data-parallel rank, the data_parallel_rank of every batch.
	Rank int
	// BlockSize is the pool's block size in tokens, BlockStored's block_size.
	BlockSize int
	// Logger receives the publisher's logs; nil discards.
	Logger *slog.Logger
}

// Publisher sends an engine's KV cache events on a ZeroMQ PUB socket and answers replay
// requests. PublishKVEvents (the engine's KVEventSink) only queues; the publisher's goroutine,
// started by Start and ended by Close, encodes and sends. Its methods are safe for concurrent use.
type Publisher struct {
	opts   Options
	log    *slog.Logger
	topic  []byte
	pub    zmq4.Socket
	replay *replayServer // nil without a replay endpoint

	mu      sync.Mutex
	queue   []batch // waiting for the goroutine, oldest first; at most MaxQueueSize
	dropped uint64  // batches dropped from a full queue
	sent    uint64  // batches sent (the next sequence number)
	closed  bool

	wake      chan struct{}  // buffered 1: the queue grew
	quit      chan struct{}  // closed by Close
	done      chan struct{}  // closed when the publishing goroutine has returned
	dialing   sync.WaitGroup // the connecting goroutine (connect mode)
	closeOnce sync.Once
}

// Start opens the sockets of opts.Config (binding or connecting the PUB socket as vLLM does,
// binding the replay socket) and starts the publishing goroutine. Close releases them.
func Start(opts Options) (*Publisher, error) {
	cfg := opts.Config
	if !cfg.Active() {
		return nil, fmt.Errorf("%w: publisher %q with enable_kv_cache_events %v publishes nothing", ErrConfig, cfg.Publisher, cfg.Enabled)
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	ep, err := splitEndpoint(cfg.Endpoint)
	if err != nil {
		return nil, fmt.Errorf("%w: endpoint: %w", ErrConfig, err)
	}
	p := &Publisher{
		opts: opts, log: opts.Logger, topic: []byte(cfg.Topic),
		wake: make(chan struct{}, 1), quit: make(chan struct{}), done: make(chan struct{}),
	}
	// The PUB socket's goroutines (zmq4's, and its dialer's retries and reconnections) end when
	// Close closes it, which cancels its context.
	p.pub = zmq4.NewPub(context.Background(), zmq4.WithDialerMaxRetries(-1), zmq4.WithDialerRetry(dialRetry),
		zmq4.WithAutomaticReconnect(!ep.bind))
	if err := p.pub.SetOption(zmq4.OptionHWM, cfg.HWM); err != nil {
		p.pub.Close()
		return nil, fmt.Errorf("kvevents: set hwm %d: %w", cfg.HWM, err)
	}
	zep := "tcp://" + ep.addr
	if ep.network == "unix" {
		zep = "ipc://" + ep.addr
	}
	if ep.bind {
		if err := p.pub.Listen(zep); err != nil {
			p.pub.Close()
			return nil, fmt.Errorf("kvevents: endpoint %s: %w", cfg.Endpoint, err)
		}
	}
	if cfg.ReplayEndpoint != "" {
		if p.replay, err = startReplay(cfg.ReplayEndpoint, cfg.BufferSteps, p.log); err != nil {
			p.pub.Close()
			return nil, fmt.Errorf("kvevents: replay_endpoint %s: %w", cfg.ReplayEndpoint, err)
		}
	}
	if !ep.bind {
		// As a ZeroMQ connect, in the background: batches sent before a subscriber listens are
		// dropped, as a PUB socket drops what no subscriber is connected for.
		p.dialing.Add(1)
		go p.connect(zep)
	}
	go p.run()
	p.log.Info("publishing KV cache events", "endpoint", cfg.Endpoint, "bound", ep.bind, "addr", p.Addr(),
		"replay_addr", p.ReplayAddr(), "topic", cfg.Topic)
	return p, nil
}

// connect dials the subscriber that binds endpoint until it answers or Close closes the socket.
func (p *Publisher) connect(ep string) {
	defer p.dialing.Done()
	if err := p.pub.Dial(ep); err != nil {
		select {
		case <-p.quit: // closed while dialing
		default:
			p.log.Warn("kvevents: cannot connect the KV event publisher", "endpoint", ep, "err", err)
		}
		return
	}
	p.log.Debug("kvevents: connected to the subscriber", "endpoint", ep)
}

// dialRetry is the pause between two attempts to connect the PUB socket.
const dialRetry = 250 * time.Millisecond

// Addr returns the PUB socket's address when it is bound (its port when the endpoint asked for
// port 0), else nil.
func (p *Publisher) Addr() net.Addr { return p.pub.Addr() }

// ReplayAddr returns the replay socket's address, or nil without one.
func (p *Publisher) ReplayAddr() net.Addr {
	if p.replay == nil {
		return nil
	}
	return p.replay.ln.Addr()
}

// Dropped returns how many batches were dropped because the queue was full.
func (p *Publisher) Dropped() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.dropped
}

// Sent returns how many batches have been sent: the next batch's sequence number.
func (p *Publisher) Sent() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.sent
}

// PublishKVEvents queues one step's events as a batch, stamped now. It never blocks: with
// MaxQueueSize batches waiting, the oldest is dropped (Dropped counts it). After Close it does
// nothing.
func (p *Publisher) PublishKVEvents(events []kvcache.Event) {
	if len(events) == 0 {
		return
	}
	b := batch{ts: time.Now(), events: events}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	if len(p.queue) >= p.opts.Config.MaxQueueSize {
		p.queue[0] = batch{}
		p.queue = p.queue[1:]
		p.dropped++
	}
	p.queue = append(p.queue, b)
	p.mu.Unlock()
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// run is the publishing goroutine: it sends queued batches until Close, then what is still
// queued, and returns.
func (p *Publisher) run() {
	defer close(p.done)
	for {
		select {
		case <-p.wake:
		case <-p.quit:
			p.flush()
			return
		}
		p.flush()
	}
}

// flush sends every queued batch in order.
func (p *Publisher) flush() {
	for {
		p.mu.Lock()
		if len(p.queue) == 0 {
			p.mu.Unlock()
			return
		}
		b := p.queue[0]
		p.queue[0] = batch{}
		p.queue = p.queue[1:]
		seq := p.sent
		p.mu.Unlock()
		payload, err := encodeBatch(b, p.opts.Rank, p.opts.BlockSize)
		if err != nil { // cannot happen: encoding into memory
			p.log.Error("kvevents: encode a batch", "err", err)
			continue
		}
		var seqb [8]byte
		binary.BigEndian.PutUint64(seqb[:], seq)
		// Kept before it is sent: a subscriber that received seq can replay from it.
		if p.replay != nil {
			p.replay.keep(seq, payload)
		}
		// The PUB socket queues (dropping beyond hwm) and returns; a write error means it is closed.
		if err := p.pub.SendMulti(zmq4.NewMsgFrom(p.topic, seqb[:], payload)); err != nil {
			p.log.Warn("kvevents: send a batch", "seq", seq, "err", err)
		}
		p.mu.Lock()
		p.sent++
		p.mu.Unlock()
	}
}

// Close sends what is queued, stops the goroutine and closes the sockets. It is idempotent.
func (p *Publisher) Close() error {
	var err error
	p.closeOnce.Do(func() {
		p.mu.Lock()
		p.closed = true
		p.mu.Unlock()
		close(p.quit)
		var errs []error
		if p.replay != nil {
			errs = append(errs, p.replay.close())
		}
		// The publishing goroutine has sent what was queued before the socket closes; closing
		// it ends a dial in progress.
		<-p.done
		if e := p.pub.Close(); e != nil && !errors.Is(e, net.ErrClosed) {
			errs = append(errs, e)
		}
		p.dialing.Wait()
		err = errors.Join(errs...)
	})
	return err
}
