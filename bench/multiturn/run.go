package multiturn

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"time"
)

// Sampling names how a client picks its next conversation.
type Sampling string

// The conversation sampling strategies (--conversation-sampling).
const (
	RoundRobin Sampling = "round_robin" // cycle through the active conversations
	Random     Sampling = "random"      // pick an active conversation at random
)

// DefaultRequestTimeout is the default per-request timeout (--request-timeout-sec 120).
const DefaultRequestTimeout = 120 * time.Second

// ErrOptions reports benchmark options that cannot work together.
var ErrOptions = errors.New("invalid benchmark options")

// Options configure Run. The zero value of each field is the CLI default.
type Options struct {
	// URL is the server's base URL; requests go to URL + "/v1/chat/completions".
	URL string
	// Model is the API "model" field (--served-model-name, else --model).
	Model string
	// Tokens counts tokens; nil uses the chars/4 estimate.
	Tokens *TokenCounter
	// Seed seeds the clients' random sources (client i uses Seed+i+1).
	Seed int64

	NumClients             int // parallel clients (0 means 1)
	MaxActiveConversations int // across all clients (0 means NumClients); each gets k / p
	MaxNumRequests         int // across all clients (0 means no cap); each gets n / p
	// WarmupStep first sends only the first user turn of every conversation (one active
	// conversation per client, no early stop) and excludes those samples.
	WarmupStep bool
	MaxTurns   int // cap on messages per conversation, user + assistant (0 means none)
	// NoEarlyStop keeps the other clients running after the first client finishes.
	NoEarlyStop bool
	// LimitMinTokens and LimitMaxTokens set min_tokens and max_tokens: 0 takes the dataset
	// answer's length, a negative value sends no limit.
	LimitMinTokens, LimitMaxTokens int
	// RequestRate is each client's Poisson request rate in requests/s (0: back to back).
	RequestRate float64
	// MaxRetries is how often a failed request is retried (exponential backoff from 1 s).
	MaxRetries int
	Sampling   Sampling
	// VerifyOutput compares every answer with the dataset's; a mismatch ends that client.
	VerifyOutput bool
	// RequestTimeout is the per-request timeout (0 means 120 s); it is raised to
	// max_tokens × 0.2 s when that is larger.
	RequestTimeout time.Duration
	NoStream       bool
	// SendConversationID adds "conversation_id" to every payload and the X-Session-ID header.
	SendConversationID bool
	// Header holds extra request headers (including Authorization for --api-key).
	Header http.Header
	// RequestSeed and Temperature, when set, are sent as "seed" and "temperature" in every
	// request, and SendMinTokens sends min_tokens (from LimitMinTokens) as older versions of
	// vLLM's script did; the current one sends none of them.
	RequestSeed   *int64
	Temperature   *float64
	SendMinTokens bool
	// Verbose (-v) reports every client's choices: the conversations it takes up, the turns it
	// sends, the conversations it finishes.
	Verbose bool
	// Content, if set (--print-content), receives every request's messages and the answer.
	Content io.Writer

	// Progress receives progress and warning lines (nil: none). With ProgressBar set, progress
	// is one self-overwriting line, for terminals.
	Progress    io.Writer
	ProgressBar bool
	// HTTPClient sends the requests (nil: a client without overall timeout).
	HTTPClient *http.Client
}

// Result is what Run measured.
type Result struct {
	// Samples are the measured requests (warm-up step excluded), in completion order.
	Samples []RequestStats
	// Conversations are the conversations that ran to their end, with the server's answers.
	Conversations []Conversation
	// NumConversations is the number of conversations the measured phase started with.
	NumConversations int
	// Failures counts requests that failed after their retries.
	Failures int
	// Runtime is the wall time of the measured phase; WarmupRuntime that of the warm-up step.
	Runtime, WarmupRuntime time.Duration
	// ActiveConversations is the effective total of active conversations (k).
	ActiveConversations int
}

// withDefaults fills in zero values and validates o against the conversation count.
func (o Options) withDefaults(numConvs int) (Options, error) {
	bad := func(format string, args ...any) (Options, error) {
		return o, fmt.Errorf("%w: %s", ErrOptions, fmt.Sprintf(format, args...))
	}
	if o.NumClients == 0 {
		o.NumClients = 1
	}
	if o.NumClients < 1 {
		return bad("number of clients %d must be a positive number", o.NumClients)
	}
	if numConvs < o.NumClients {
		return bad("number of conversations (%d) must be equal or larger than the number of clients (%d)", numConvs, o.NumClients)
	}
	if o.MaxNumRequests < 0 {
		return bad("max number of requests %d must be positive", o.MaxNumRequests)
	}
	if o.MaxNumRequests > 0 && o.MaxNumRequests/o.NumClients < 1 {
		return bad("max number of requests (%d) should be at least one per client (%d clients)", o.MaxNumRequests, o.NumClients)
	}
	if o.MaxActiveConversations == 0 {
		o.MaxActiveConversations = o.NumClients
	}
	if o.MaxActiveConversations > numConvs {
		return bad("max active conversations %d must be equal or less than the total number of conversations (%d)", o.MaxActiveConversations, numConvs)
	}
	if o.MaxActiveConversations/o.NumClients < 1 {
		return bad("max active conversations %d must be equal or greater than the number of clients (%d)", o.MaxActiveConversations, o.NumClients)
	}
	if o.MaxTurns < 0 {
		return bad("max turns %d must be a positive number", o.MaxTurns)
	}
	if o.LimitMinTokens > 0 || o.LimitMaxTokens > 0 {
		if o.LimitMinTokens < 1 || o.LimitMaxTokens < 1 {
			return bad("invalid min/max tokens limits %d/%d (both limits should be provided)", o.LimitMinTokens, o.LimitMaxTokens)
		}
		if o.LimitMinTokens > o.LimitMaxTokens {
			return bad("invalid min/max tokens limits %d/%d (min should not be larger than max)", o.LimitMinTokens, o.LimitMaxTokens)
		}
	}
	if o.RequestRate < 0 {
		return bad("request rate %g must not be negative", o.RequestRate)
	}
	if o.MaxRetries < 0 {
		return bad("max retries %d must not be negative", o.MaxRetries)
	}
	switch o.Sampling {
	case "":
		o.Sampling = RoundRobin
	case RoundRobin, Random:
	default:
		return bad("conversation sampling %q: want round_robin or random", o.Sampling)
	}
	if o.RequestTimeout == 0 {
		o.RequestTimeout = DefaultRequestTimeout
	}
	if o.RequestTimeout < 0 {
		return bad("request timeout %v must be a positive number", o.RequestTimeout)
	}
	if o.Tokens == nil {
		o.Tokens = EstimateTokenCounter("no tokenizer given")
	}
	if o.HTTPClient == nil {
		o.HTTPClient = &http.Client{}
	}
	if o.URL == "" {
		return bad("no server URL")
	}
	o.URL = strings.TrimRight(o.URL, "/")
	return o, nil
}

// Run benchmarks the server at opts.URL with convs (which it does not modify): an optional
// warm-up step, then the measured phase. On cancellation it returns what was measured so far
// together with the context's error.
//
// The simulation is vLLM's: NumClients goroutines share a queue of conversations; each keeps up
// to MaxActiveConversations/NumClients of them active, picks the next one round robin (the
// newest first, then cycling) or at random, and sends its next user turn with the history so far,
// the server's earlier answers included. A conversation ends when its messages (or MaxTurns)
// run out; a rejected request (HTTP error, empty stream) drops it; any other failure (timeout,
// connection error, verify mismatch) also ends its client. A client stops when the request cap
// is reached or when it finds the queue empty while refilling — leaving its other active
// conversations unfinished, as the original does — and, unless NoEarlyStop, the first client
// to stop stops the others after their current request.
func Run(ctx context.Context, convs []Conversation, opts Options) (*Result, error) {
	o, err := opts.withDefaults(len(convs))
	if err != nil {
		return nil, err
	}
	work := make([]*Conversation, len(convs))
	for i := range convs {
		c := convs[i].clone()
		work[i] = &c
	}
	q := &requester{
		http: o.HTTPClient, chatURL: o.URL + "/v1/chat/completions", model: o.Model,
		stream: !o.NoStream, timeout: o.RequestTimeout, header: o.Header, sendConv: o.SendConversationID,
		seed: o.RequestSeed, temperature: o.Temperature, sendMinTokens: o.SendMinTokens,
	}
	origin := time.Now()
	cc := clientConfig{
		maxTurns:    o.MaxTurns,
		activeQuota: o.MaxActiveConversations / o.NumClients,
		random:      o.Sampling == Random,
		requestRate: o.RequestRate,
		maxRetries:  o.MaxRetries,
		verify:      o.VerifyOutput,
		limitMin:    o.LimitMinTokens,
		limitMax:    o.LimitMaxTokens,
		origin:      origin,
		verbose:     o.Verbose,
		content:     o.Content != nil,
	}
	if o.MaxNumRequests > 0 {
		cc.maxRequests = o.MaxNumRequests / o.NumClients
	}
	res := &Result{ActiveConversations: o.MaxActiveConversations}
	pr := newProgress(o.Progress, o.ProgressBar)
	if o.WarmupStep {
		wc := cc
		wc.skipFirstTurn, wc.maxTurns, wc.activeQuota = false, 1, 1
		pr.logf("warm-up step: sending the first user turn of %d conversations", len(work))
		t0 := time.Now()
		ph := runPhase(ctx, work, o, wc, q, pr, "warm-up", false)
		res.WarmupRuntime = time.Since(t0)
		pr.logf("warm-up done in %.3f s (%d requests, %d failed)", res.WarmupRuntime.Seconds(), len(ph.samples), ph.failures)
		if err := ctx.Err(); err != nil {
			return res, err
		}
		work = ph.finished
		cc.skipFirstTurn = true
	}
	res.NumConversations = len(work)
	t0 := time.Now()
	ph := runPhase(ctx, work, o, cc, q, pr, "benchmark", !o.NoEarlyStop)
	res.Runtime = time.Since(t0)
	res.Samples, res.Failures = ph.samples, ph.failures
	for _, c := range ph.finished {
		res.Conversations = append(res.Conversations, *c)
	}
	return res, ctx.Err()
}

// phaseResult is what one phase collected.
type phaseResult struct {
	samples  []RequestStats
	finished []*Conversation
	failures int
}

// runPhase starts the clients on convs and collects their events until all have exited; with
// earlyStop the first client to exit stops the others (after their current request).
func runPhase(ctx context.Context, convs []*Conversation, o Options, cc clientConfig, q *requester, pr *progress, name string, earlyStop bool) phaseResult {
	tasks := make(chan *Conversation, len(convs))
	for _, c := range convs {
		tasks <- c
	}
	close(tasks)
	events := make(chan clientEvent)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for i := range o.NumClients {
		seed := uint64(o.Seed) + uint64(i) + 1
		c := &client{
			id: i, cfg: cc, q: q, tc: o.Tokens, tasks: tasks, out: events, stop: stop,
			rng: rand.New(rand.NewPCG(seed, seed^0x636c69656e74)),
		}
		wg.Go(func() { c.run(ctx) })
	}
	var res phaseResult
	expected := 0
	for _, c := range convs {
		limit := len(c.Messages)
		if cc.maxTurns > 0 {
			limit = min(limit, cc.maxTurns)
		}
		start := 0
		if cc.skipFirstTurn {
			start = 2
		}
		if limit > start {
			expected += (limit - start + 1) / 2
		}
	}
	if cc.maxRequests > 0 {
		expected = min(expected, cc.maxRequests*o.NumClients)
	}
	pr.begin(name, len(convs), o.NumClients, expected)
	exited, stopped := 0, false
	for exited < o.NumClients {
		var ev clientEvent
		select {
		case ev = <-events:
		case <-ctx.Done():
			// Clients see the cancellation at their next step; wait for them without collecting.
			wg.Wait()
			pr.end()
			return res
		}
		switch {
		case ev.content != "":
			fmt.Fprint(o.Content, ev.content)
		case ev.log != "":
			pr.logf("%s", ev.log)
		case ev.sample != nil:
			res.samples = append(res.samples, *ev.sample)
			pr.sample(*ev.sample)
		case ev.failed:
			res.failures++
			pr.failure()
		case ev.finished != nil:
			res.finished = append(res.finished, ev.finished)
			pr.finished()
		case ev.exited:
			exited++
			pr.clientExited()
			if earlyStop && !stopped && exited < o.NumClients {
				stopped = true
				close(stop)
				pr.logf("client %d finished: stopping the other clients (early stop; --no-early-stop to disable)", ev.client)
			}
		}
	}
	wg.Wait()
	pr.end()
	return res
}
