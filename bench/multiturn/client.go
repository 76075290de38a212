package multiturn

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/kvbridge/kvbridge/stats"
)

// clientConfig is what one client needs to know; a phase gives every client the same one.
type clientConfig struct {
	maxRequests   int // per client; 0 = unlimited
	skipFirstTurn bool
	maxTurns      int // 0 = no limit
	activeQuota   int
	random        bool
	requestRate   float64
	maxRetries    int
	verify        bool
	limitMin      int
	limitMax      int
	origin        time.Time
	verbose       bool // -v: report the client's choices
	content       bool // --print-content: report messages and answers
}

// clientEvent is what a client reports to the phase's collector.
type clientEvent struct {
	sample   *RequestStats
	finished *Conversation
	failed   bool
	exited   bool
	client   int
	log      string
	content  string // printed as is (--print-content)
}

// errMismatch marks a --verify-output mismatch; it ends the client without retries.
var errMismatch = errors.New("LLM/dataset answers do not match")

// client is one simulated user population: a goroutine holding up to activeQuota conversations.
type client struct {
	id    int
	cfg   clientConfig
	q     *requester
	tc    *TokenCounter
	rng   *rand.Rand
	tasks <-chan *Conversation
	out   chan<- clientEvent
	stop  <-chan struct{}
}

// run is the client's loop (vLLM's client_main): fill the active set from the shared queue,
// pick a conversation (round robin or random), send its next user turn with retries, and pace
// with exponential think times when a request rate is set. It exits when the queue runs dry at a
// refill, the request cap is reached, the benchmark stops, or a request fails with an error.
func (c *client) run(ctx context.Context) {
	defer func() { c.emit(ctx, clientEvent{exited: true}) }()
	set := activeSet{active: map[string]*Conversation{}, turns: map[string]int{}}
	successes, failures := 0, 0
	queueEmpty := false
	for !queueEmpty {
		if c.cfg.maxRequests > 0 && successes+failures >= c.cfg.maxRequests {
			c.logf(ctx, "client %d reached its request limit (%d)", c.id, c.cfg.maxRequests)
			return
		}
		if c.stopped(ctx) {
			return
		}
		queueEmpty = c.refill(ctx, &set)
		if len(set.active) == 0 || queueEmpty {
			return
		}
		id := set.pick(c)
		conv := set.active[id]
		set.turns[id]++
		cur := set.turns[id]
		c.verbosef(ctx, "client %d using conversation ID %s (turn: %d)", c.id, id, cur)

		began := time.Now()
		st, lastErr := c.sendWithRetries(ctx, conv, cur)
		if lastErr != nil {
			failures++
			set.remove(id)
			c.emit(ctx, clientEvent{failed: true})
			if errors.Is(lastErr, errMismatch) {
				c.logf(ctx, "client %d: %v", c.id, lastErr)
			}
			if !errors.Is(lastErr, errRejected) {
				return // an error (not a rejection) ends the client, as in the original
			}
		} else {
			successes++
			c.emit(ctx, clientEvent{sample: st})
			c.turnDone(ctx, &set, conv)
		}
		if c.cfg.requestRate > 0 {
			mean := time.Duration(float64(time.Second)/c.cfg.requestRate) - time.Since(began)
			if mean > 0 && !c.sleep(ctx, time.Duration(c.rng.ExpFloat64()*float64(mean))) {
				return
			}
		}
	}
}

// activeSet is a client's active conversations.
type activeSet struct {
	active map[string]*Conversation
	order  []string // active ids in insertion order (random sampling)
	ring   []string // round-robin deque: take from the back, requeue at the front
	turns  map[string]int
}

// remove drops conversation id from the active set.
func (a *activeSet) remove(id string) {
	delete(a.active, id)
	for i, x := range a.order {
		if x == id {
			a.order = append(a.order[:i], a.order[i+1:]...)
			break
		}
	}
}

// pick takes the conversation whose turn is next: a random one, or the round robin's next.
func (a *activeSet) pick(c *client) string {
	if c.cfg.random {
		return a.order[c.rng.IntN(len(a.order))]
	}
	id := a.ring[len(a.ring)-1]
	a.ring = a.ring[:len(a.ring)-1]
	return id
}

// refill fills the active set up to the client's quota from the shared queue; it reports
// whether the queue ran dry.
func (c *client) refill(ctx context.Context, a *activeSet) (queueEmpty bool) {
	for len(a.active) < c.cfg.activeQuota {
		conv, ok := <-c.tasks
		if !ok {
			return true
		}
		if c.cfg.skipFirstTurn {
			a.turns[conv.ID] += 2
		}
		if a.turns[conv.ID] < len(conv.Messages) {
			a.active[conv.ID] = conv
			a.order = append(a.order, conv.ID)
			a.ring = append(a.ring, conv.ID)
			c.verbosef(ctx, "client %d will use conversation ID %s (active conversations %d)", c.id, conv.ID, len(a.active))
		} else {
			c.verbosef(ctx, "client %d will not use conversation ID %s (all %d messages already sent)", c.id, conv.ID, len(conv.Messages))
		}
	}
	return false
}

// turnDone counts conv's answered turn: the conversation is finished at its last message (or
// --max-turns), else requeued for round robin.
func (c *client) turnDone(ctx context.Context, a *activeSet, conv *Conversation) {
	id := conv.ID
	a.turns[id]++
	limit := len(conv.Messages)
	if c.cfg.maxTurns > 0 {
		limit = min(limit, c.cfg.maxTurns)
	}
	if a.turns[id] >= limit {
		a.remove(id)
		c.verbosef(ctx, "client %d finished conversation ID %s", c.id, id)
		c.emit(ctx, clientEvent{finished: conv})
	} else if !c.cfg.random {
		a.ring = append([]string{id}, a.ring...)
	}
}

// sendWithRetries sends user turn cur of conv, retrying a failure (but not a mismatch, or once
// ctx ended) up to --max-retries times with exponential backoff.
func (c *client) sendWithRetries(ctx context.Context, conv *Conversation, cur int) (*RequestStats, error) {
	var (
		st      *RequestStats
		lastErr error
	)
	for attempt := 0; attempt <= c.cfg.maxRetries; attempt++ {
		st, lastErr = c.sendTurn(ctx, conv, cur)
		if lastErr == nil {
			break
		}
		if ctx.Err() != nil || errors.Is(lastErr, errMismatch) {
			break
		}
		c.logf(ctx, "client %d: conversation %s, turn %d (attempt %d of %d): %v", c.id, conv.ID, (cur+1)/2, attempt+1, c.cfg.maxRetries+1, lastErr)
		if attempt < c.cfg.maxRetries && !c.sleep(ctx, backoff(c.rng, attempt)) {
			break
		}
	}
	return st, lastErr
}

// sendTurn sends messages[:cur] of conv (ending with user turn cur) and, on success, stores the
// answer in conv as message cur.
func (c *client) sendTurn(ctx context.Context, conv *Conversation, cur int) (*RequestStats, error) {
	msgs := conv.Messages[:cur]
	last := msgs[cur-1]
	if last.Role != "user" {
		return nil, fmt.Errorf("conversation %s: message %d has role %q, want user", conv.ID, cur-1, last.Role)
	}
	var minTok, maxTok *int
	if c.cfg.limitMin >= 0 {
		v := c.cfg.limitMin
		minTok = &v
	}
	if c.cfg.limitMax >= 0 {
		v := c.cfg.limitMax
		maxTok = &v
	}
	if len(conv.Messages) > cur && (c.cfg.limitMin == 0 || c.cfg.limitMax == 0) {
		answer := max(1, c.tc.Count(conv.Messages[cur].Content))
		if c.cfg.limitMin == 0 {
			*minTok = answer
		}
		if c.cfg.limitMax == 0 {
			*maxTok = answer
		}
	}
	// "From the dataset" without a dataset answer means no limit.
	if minTok != nil && *minTok == 0 {
		minTok = nil
	}
	if maxTok != nil && *maxTok == 0 {
		maxTok = nil
	}

	if c.cfg.content {
		data, _ := json.Marshal(msgs)
		c.emit(ctx, clientEvent{content: fmt.Sprintf("Messages (conversation ID %s, %d turns): %s\n", conv.ID, len(msgs), data)})
	}
	r, err := c.q.send(ctx, conv.ID, msgs, minTok, maxTok)
	if err != nil {
		return nil, err
	}
	st := &RequestStats{
		LatencyMs:      stats.Ms(r.latency),
		StartTimeMs:    stats.Ms(r.start.Sub(c.cfg.origin)),
		InputNumTurns:  len(msgs),
		ConversationID: conv.ID,
		ClientID:       c.id,
	}
	question := 0
	for i, m := range msgs {
		n := c.tc.Count(m.Content)
		st.InputNumTokens += n
		if i == len(msgs)-1 {
			question = n
		}
	}
	if st.InputNumTokens > 0 {
		st.ApproxCachedPercent = 100 * float64(st.InputNumTokens-question) / float64(st.InputNumTokens)
	}
	st.OutputNumFirstChunkTokens = c.tc.Count(r.firstChunk)
	st.OutputNumTokens = c.tc.Count(r.content)
	st.OutputNumChunks = r.chunks
	st.TTFTMs, st.TPOTMs = tokenTimings(stats.Ms(r.ttft), st.LatencyMs, st.OutputNumTokens, st.OutputNumFirstChunkTokens)

	if c.cfg.content {
		c.emit(ctx, clientEvent{content: fmt.Sprintf("\nResponse (%d tokens): %s\nResponse metrics: ttft_ms %.2f, tpot_ms %.2f, latency_ms %.2f, input_num_tokens %d, output_num_tokens %d\n%s\n",
			st.OutputNumTokens, r.content, st.TTFTMs, st.TPOTMs, st.LatencyMs, st.InputNumTokens, st.OutputNumTokens, strings.Repeat("-", 70))})
	}
	if len(conv.Messages) > cur {
		orig := conv.Messages[cur].Content
		if c.cfg.verify && orig != r.content {
			return nil, fmt.Errorf("%w (%s, turn %d):\n%q (len: %d),\n%q (len: %d)", errMismatch, conv.ID, (cur+1)/2,
				shorten(r.content), len(r.content), shorten(orig), len(orig))
		}
		conv.Messages[cur].Content = r.content
	} else {
		conv.Messages = append(conv.Messages, Message{Role: "assistant", Content: r.content})
	}
	return st, nil
}

// tokenTimings turns chunk timings into token timings: TPOT is the time after the first chunk
// divided by the tokens after it (0 when the first chunk held all output), and a first chunk of
// k > 1 tokens has its TTFT reduced by (k−1)·TPOT, to at least 0.1 ms. A non-positive chunk TTFT
// is reported as −1.
func tokenTimings(chunkTTFTMs, latencyMs float64, outTokens, firstTokens int) (ttftMs, tpotMs float64) {
	if chunkTTFTMs <= 0 {
		chunkTTFTMs = -1
	}
	if outTokens > 1 && outTokens > firstTokens {
		tpotMs = (latencyMs - chunkTTFTMs) / float64(outTokens-firstTokens)
	}
	ttftMs = chunkTTFTMs
	if firstTokens > 1 {
		ttftMs = max(0.1, chunkTTFTMs-float64(firstTokens-1)*tpotMs)
	}
	return ttftMs, tpotMs
}

// emit sends ev to the collector unless the run is being torn down.
func (c *client) emit(ctx context.Context, ev clientEvent) {
	ev.client = c.id
	select {
	case c.out <- ev:
	case <-ctx.Done():
	}
}

// logf reports a message through the collector (so it does not garble the progress bar).
func (c *client) logf(ctx context.Context, format string, args ...any) {
	c.emit(ctx, clientEvent{log: fmt.Sprintf(format, args...)})
}

// verbosef reports a message with -v only.
func (c *client) verbosef(ctx context.Context, format string, args ...any) {
	if c.cfg.verbose {
		c.logf(ctx, format, args...)
	}
}

// stopped reports whether the benchmark asked clients to stop or was cancelled.
func (c *client) stopped(ctx context.Context) bool {
	select {
	case <-c.stop:
		return true
	case <-ctx.Done():
		return true
	default:
		return false
	}
}

// sleep waits d; it returns false when the benchmark stopped or was cancelled meanwhile.
func (c *client) sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-c.stop:
		return false
	case <-ctx.Done():
		return false
	}
}

// backoff is the delay before retry attempt+1: 1 s × 2^attempt, ±10 % jitter.
func backoff(r *rand.Rand, attempt int) time.Duration {
	d := float64(time.Second) * float64(int64(1)<<min(attempt, 20))
	return time.Duration(d * (1 + (r.Float64()*2-1)*0.1))
}
