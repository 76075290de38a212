package openai

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"

	"github.com/kvbridge/kvbridge/engine"
	"github.com/kvbridge/kvbridge/model"
)

// abortGrace bounds the wait for the engine's final outputs after the client went away (or a
// sibling sequence failed and the others were aborted).
const abortGrace = 10 * time.Second

// errClientGone reports that the client disconnected; nothing more can be written.
var errClientGone = errors.New("openai: client disconnected")

// job is one generation: the engine requests of its sequences and how to present them.
type job struct {
	chat    bool
	id      string // response id: cmpl-<base> or chatcmpl-<base>
	created int64
	model   string
	prompt  []int32
	// reqs are the sequences: best_of of them (n unless best_of is larger). Only the first
	// carries the request's kv_transfer_params.
	reqs []*engine.Request
	p    genParams
	// echo (completions) prepends the prompt, echoText, to every choice; noGeneration
	// (echo with max_tokens 0) returns only the prompt.
	echo         bool
	echoText     string
	noGeneration bool
	// chatEcho (chat with echo) is the final assistant message the request continues, shown
	// before every choice's content.
	chatEcho string
}

// seqResult is what one sequence produced.
type seqResult struct {
	text       []byte
	tokens     []int32
	logprobs   []model.PositionLogprobs
	prompt     []model.PositionLogprobs // prompt logprobs
	finish     string
	kv         map[string]any
	usage      usageInfo // this sequence's counts (cached tokens as reported)
	cached     int
	external   int
	started    bool // its first output arrived
	last       time.Time
	sentRunes  int  // characters streamed so far (completions text_offset)
	echoed     bool // the streamed echo went out
	cumLogprob float64
}

// engineID returns a unique engine request id for a response id: vLLM appends a random suffix
// to external ids so that a reused X-Request-Id never collides inside the engine.
func engineID(prefix string) string { return prefix + "-" + uuid.NewString()[:8] }

// engineRequests builds the sequences of a validated prompt and parameters. Sequence i of a
// seeded request uses seed+i (as vLLM's parallel sampling does); only sequence 0 carries the
// kv_transfer_params. Every sequence computes logprobs when best_of must rank them. The stop
// strings and stop token ids are compiled once and shared by all the sequences.
func (s *Server) engineRequests(idPrefix string, prompt []int32, p genParams) []*engine.Request {
	reqs := make([]*engine.Request, p.bestOf)
	stops := engine.NewStops(p.stop, p.stopTokenIDs)
	for i := range reqs {
		r := &engine.Request{
			ID:                engineID(idPrefix),
			Prompt:            prompt,
			Sampling:          p.sampling,
			MaxTokens:         p.maxTokens,
			MinTokens:         p.minTokens,
			Stop:              p.stop,
			StopTokenIDs:      p.stopTokenIDs,
			Stops:             stops,
			IgnoreEOS:         p.ignoreEOS,
			Logprobs:          p.logprobs || p.bestOf > p.n,
			TopLogprobs:       p.topLogprobs,
			PromptLogprobs:    p.promptLogprobs,
			TopPromptLogprobs: p.topPromptLogprobs,
		}
		if i == 0 {
			r.KVTransfer = p.kvTransfer
		} else {
			r.ID = fmt.Sprintf("%s_%d", r.ID, i)
		}
		if seed := p.sampling.Seed; seed != 0 && i > 0 {
			if seed == explicitSeedZero {
				seed = 0
			}
			r.Sampling.Seed = seed + int64(i)
			if r.Sampling.Seed == 0 {
				r.Sampling.Seed = explicitSeedZero
			}
		}
		reqs[i] = r
	}
	return reqs
}

// addError maps an engine.Add error to the HTTP error.
func (s *Server) addError(err error) *APIError {
	switch {
	case errors.Is(err, engine.ErrInvalidRequest):
		return badRequest("", "%v", err)
	case errors.Is(err, engine.ErrClosed):
		return unavailable()
	}
	s.log.Error("engine rejected request", "err", err)
	return internalError()
}

// seqEvent is one output of sequence idx.
type seqEvent struct {
	idx int
	out engine.Output
}

// runner drives a job's sequences: it adds them to the engine, forwards their outputs to one
// channel and records what they produced. Its forwarding goroutines end by close.
type runner struct {
	// Set by startJob, read-only afterwards.
	s       *Server
	j       *job
	client  context.Context // the HTTP request's context
	ctx     context.Context // the sequences' context: cancelled to abort them all
	cancel  context.CancelFunc
	events  chan seqEvent
	stop    chan struct{}
	release func()
	start   time.Time
	// share: sequences 1.. are added once sequence 0 has computed the prompt, so that they
	// find its blocks in the prefix cache. Sequence 0's forwarder adds them (addShared).
	share bool

	// Owned by the collector (wait and what it calls).
	res      []*seqResult
	gotToken bool

	// Safe for concurrent use.
	wg sync.WaitGroup // the forwarding goroutines
	// ended counts the sequences the engine has ended (their final output came); when all of
	// the job's have, release gives the request's concurrency slots back.
	ended atomic.Int32

	mu     sync.Mutex
	added  int       // sequences the engine took
	addErr *APIError // why addShared could not add them all, for the collector
}

// startJob adds the job's first sequence (and, unless they wait for it, the others); release is
// called once the engine has ended all of them. On an error, taken reports whether the engine
// took a sequence before it: that sequence, aborted, carried the kv_transfer_params, so the
// engine's connector tells the producer itself and the request must not be declined as well.
func (s *Server) startJob(ctx context.Context, j *job, release func()) (rn *runner, taken bool, apiErr *APIError) {
	rn = &runner{s: s, j: j, client: ctx, events: make(chan seqEvent), stop: make(chan struct{}),
		res: make([]*seqResult, len(j.reqs)), start: time.Now(), release: release}
	rn.ctx, rn.cancel = context.WithCancel(ctx)
	for i := range rn.res {
		rn.res[i] = &seqResult{}
	}
	rn.share = len(j.reqs) > 1 && !j.p.promptLogprobs && s.prefixCaching()
	rn.mu.Lock()
	apiErr = rn.add()
	if apiErr == nil && !rn.share {
		taken = true
		apiErr = rn.addRest()
	}
	rn.mu.Unlock()
	if apiErr != nil {
		rn.close() // aborts sequence 0 if the engine took it
		return nil, taken, apiErr
	}
	return rn, true, nil
}

// prefixCaching reports whether the engine caches prefixes (when it says).
func (s *Server) prefixCaching() bool {
	ec, ok := s.engine.(interface{ Config() engine.Config })
	return ok && ec.Config().PrefixCaching
}

// add adds the next sequence and starts forwarding its outputs. rn.mu must be held.
func (rn *runner) add() *APIError {
	i := rn.added
	st, err := rn.s.engine.Add(rn.ctx, rn.j.reqs[i])
	if err != nil {
		return rn.s.addError(err)
	}
	rn.added++
	rn.wg.Add(1)
	go func() {
		defer rn.wg.Done()
		rn.forward(i, st.C())
	}()
	return nil
}

// forward hands sequence i's outputs to the collector. It takes them from the engine as they
// come, even while the collector is busy (writing to a client that reads slowly, or not at all):
// what the collector has not taken yet is merged into one output, as the engine merges for a
// slow reader. So the engine's end of a sequence is seen at once, whatever the client does: it
// is counted (seqEnded) before the collector hears of it. It returns at the stream's end, once
// the collector has everything, or when close stops it (the context's cancel aborts the
// sequence).
func (rn *runner) forward(i int, in <-chan engine.Output) {
	var (
		next  engine.Output // not yet taken by the collector
		have  bool
		first = true
	)
	for in != nil || have {
		var out chan<- seqEvent
		if have {
			out = rn.events
		}
		select {
		case o, ok := <-in:
			switch {
			case !ok:
				in = nil
				continue
			case o.Finished:
				rn.seqEnded()
			}
			if i == 0 && first && rn.share && (!o.Finished || o.FinishReason == engine.FinishStop || o.FinishReason == engine.FinishLength) {
				rn.addShared() // sequence 0 has computed the prompt
			}
			first = false
			if have {
				mergeOutput(&next, o)
			} else {
				next, have = o, true
			}
		case out <- seqEvent{idx: i, out: next}:
			next, have = engine.Output{}, false
		case <-rn.stop:
			return
		}
	}
}

// addShared adds the sequences that wait for sequence 0's prompt; sequence 0's forwarder calls
// it at its first output, whatever the collector is doing (it may be stuck writing to a client),
// so that they run, end and give their slots back without waiting for the client. Nothing is
// added once the request is aborted; a failure to add aborts the request and is left in addErr
// for the collector, which reads it when it takes that first output.
func (rn *runner) addShared() {
	rn.mu.Lock()
	defer rn.mu.Unlock()
	if rn.ctx.Err() != nil {
		return
	}
	if apiErr := rn.addRest(); apiErr != nil {
		rn.addErr = apiErr
		rn.cancel()
	}
}

// numAdded returns how many sequences the engine took.
func (rn *runner) numAdded() int {
	rn.mu.Lock()
	defer rn.mu.Unlock()
	return rn.added
}

// seqEnded counts a sequence the engine has ended; at the job's last, the request's concurrency
// slots are given back.
func (rn *runner) seqEnded() {
	if int(rn.ended.Add(1)) == len(rn.j.reqs) && rn.release != nil {
		rn.release()
	}
}

// mergeOutput appends o, which came after p, to p (as the engine coalesces a slow reader's
// outputs). p's slices are copied before they grow: they may share memory with the engine's.
func mergeOutput(p *engine.Output, o engine.Output) {
	p.Tokens = append(slices.Clip(p.Tokens), o.Tokens...)
	p.Logprobs = append(slices.Clip(p.Logprobs), o.Logprobs...)
	if o.PromptLogprobs != nil {
		p.PromptLogprobs = o.PromptLogprobs
	}
	p.Text += o.Text
	p.Finished, p.FinishReason = o.Finished, o.FinishReason
	p.PromptTokens, p.CachedTokens, p.CompletionTokens = o.PromptTokens, o.CachedTokens, o.CompletionTokens
	p.ExternalCachedTokens = o.ExternalCachedTokens
	if o.KVTransfer != nil {
		p.KVTransfer = o.KVTransfer
	}
	if o.Err != nil {
		p.Err = o.Err
	}
}

// addRest adds the sequences not added yet. rn.mu must be held.
func (rn *runner) addRest() *APIError {
	for rn.added < len(rn.j.reqs) {
		if apiErr := rn.add(); apiErr != nil {
			return apiErr
		}
	}
	return nil
}

// close aborts whatever still runs and waits for the forwarding goroutines.
func (rn *runner) close() {
	rn.cancel()
	close(rn.stop)
	rn.wg.Wait()
}

// wait reads the sequences' outputs until all have finished, recording metrics and calling
// each (if non-nil) for every output of a sequence that has not failed. It returns errClientGone
// if the client went away, or an APIError for a sequence that ended in error (the others are
// then aborted).
func (rn *runner) wait(each func(i int, o engine.Output)) (*APIError, error) {
	w := &waiter{rn: rn, each: each}
	defer w.stopGrace()
	done := rn.client.Done()
	for w.finished < rn.numAdded() || w.pending() {
		select {
		case <-done:
			done = nil
			w.startGrace()
		case <-w.grace:
			rn.s.log.Warn("engine did not finish an aborted request in time", "request_id", rn.j.reqs[0].ID)
			return rn.outcome(w.failure)
		case ev := <-rn.events:
			w.take(ev)
		}
	}
	if w.finished == len(rn.j.reqs) { // vLLM's parent request finished: its n and longest output
		longest := 0
		for _, r := range rn.res {
			longest = max(longest, r.usage.CompletionTokens)
		}
		rn.s.metrics.ObserveParentRequest(rn.j.p.n, longest)
	}
	return rn.outcome(w.failure)
}

// outcome is wait's result once it stops: errClientGone if the client went away, else failure.
func (rn *runner) outcome(failure *APIError) (*APIError, error) {
	if rn.client.Err() != nil {
		return nil, errClientGone
	}
	return failure, nil
}

// waiter is the state of one runner.wait, owned by the collector goroutine.
type waiter struct {
	rn       *runner
	each     func(i int, o engine.Output)
	grace    <-chan time.Time // fires abortGrace after the client left or a sequence failed
	timer    *time.Timer
	failure  *APIError // the first sequence failure
	finished int       // sequences whose final output was taken
}

// startGrace starts the wait for the engine's final outputs after an abort, once.
func (w *waiter) startGrace() {
	if w.timer == nil {
		w.timer = time.NewTimer(abortGrace)
		w.grace = w.timer.C
	}
}

// stopGrace stops the grace timer, if started.
func (w *waiter) stopGrace() {
	if w.timer != nil {
		w.timer.Stop()
	}
}

// pending reports whether sequences are still to be added once sequence 0 has started (and so
// are not counted yet).
func (w *waiter) pending() bool {
	rn := w.rn
	return rn.share && !rn.res[0].started && w.failure == nil && rn.client.Err() == nil
}

// deliver hands an output to each, unless the request has failed.
func (w *waiter) deliver(i int, o engine.Output) {
	if w.each != nil && w.failure == nil {
		w.each(i, o)
	}
}

// take records one output of a sequence and, at a sequence's end, its finish or its failure;
// a failure aborts the other sequences.
func (w *waiter) take(ev seqEvent) {
	rn := w.rn
	r := rn.res[ev.idx]
	o := ev.out
	rn.record(ev.idx, o)
	ok := !o.Finished || o.FinishReason == engine.FinishStop || o.FinishReason == engine.FinishLength
	if ev.idx == 0 && !r.started && ok && w.pending() {
		// Sequence 0 has computed the prompt: its forwarder has added the others, which
		// start from its cached blocks, or failed to.
		if addErr := rn.sharedAddErr(); addErr != nil {
			w.failure = addErr
			w.startGrace()
		}
	}
	r.started = true
	if !o.Finished {
		w.deliver(ev.idx, o)
		return
	}
	w.finished++
	rn.s.metrics.ObserveFinished(string(o.FinishReason), time.Since(rn.start))
	switch o.FinishReason {
	case engine.FinishStop, engine.FinishLength:
		r.finish = string(o.FinishReason)
		r.kv = o.KVTransfer
		w.deliver(ev.idx, o)
		return
	}
	if w.failure != nil || rn.client.Err() != nil {
		return // an abort we caused, or the client's
	}
	w.failure = rn.seqFailure(ev.idx, o)
	rn.cancel() // the other sequences cannot make a response any more
	w.startGrace()
}

// seqFailure maps sequence i's final output that ended it in neither stop nor length to the
// response's error, logging what the client is not told.
func (rn *runner) seqFailure(i int, o engine.Output) *APIError {
	switch {
	case o.FinishReason == engine.FinishAbort && errors.Is(o.Err, engine.ErrClosed):
		return unavailable()
	case o.FinishReason == engine.FinishAbort:
		rn.s.log.Error("request aborted by the engine", "request_id", rn.j.reqs[i].ID, "err", o.Err)
	default: // engine.FinishError: forward failure, KV load failure under policy fail, …
		rn.s.log.Error("request failed", "request_id", rn.j.reqs[i].ID, "finish_reason", o.FinishReason, "err", o.Err)
	}
	return internalError()
}

// sharedAddErr returns why addShared could not add all the sequences, if it could not.
func (rn *runner) sharedAddErr() *APIError {
	rn.mu.Lock()
	defer rn.mu.Unlock()
	return rn.addErr
}

// record adds an output to its sequence's result and to the metrics.
func (rn *runner) record(i int, o engine.Output) {
	r := rn.res[i]
	now := time.Now()
	if n := len(o.Tokens); n > 0 {
		// One inter-token latency per token after the first, as vLLM records per step; an
		// Output coalescing n tokens spreads its gap over them.
		m := rn.s.metrics
		if !rn.gotToken {
			rn.gotToken = true
			m.ObserveTimeToFirstToken(now.Sub(rn.start))
			m.AddPromptTokens(max(o.PromptTokens, len(rn.j.prompt)))
		}
		if r.last.IsZero() {
			for range n - 1 {
				m.ObserveInterTokenLatency(0)
			}
		} else {
			gap := now.Sub(r.last) / time.Duration(n)
			for range n {
				m.ObserveInterTokenLatency(gap)
			}
		}
		r.last = now
		m.AddGenerationTokens(n)
	}
	r.text = append(r.text, o.Text...)
	r.tokens = append(r.tokens, o.Tokens...)
	r.logprobs = append(r.logprobs, o.Logprobs...)
	for _, lp := range o.Logprobs {
		r.cumLogprob += lp.Token.Logprob
	}
	if o.PromptLogprobs != nil {
		r.prompt = o.PromptLogprobs
	}
	if o.CachedTokens > 0 {
		r.cached, r.external = o.CachedTokens, o.ExternalCachedTokens
	}
	r.usage.PromptTokens = len(rn.j.prompt)
	if o.PromptTokens > 0 {
		r.usage.PromptTokens = o.PromptTokens
	}
	r.usage.CompletionTokens = max(o.CompletionTokens, len(r.tokens))
	r.usage.TotalTokens = r.usage.PromptTokens + r.usage.CompletionTokens
}

// usage returns the usage of the sequences at idx: the prompt once, their completion tokens
// summed, and (with --enable-prompt-tokens-details) the first sequence's cached tokens.
func (s *Server) usage(j *job, res []*seqResult, idx []int) usageInfo {
	u := usageInfo{PromptTokens: max(res[0].usage.PromptTokens, len(j.prompt))}
	for _, i := range idx {
		u.CompletionTokens += res[i].usage.CompletionTokens
	}
	u.TotalTokens = u.PromptTokens + u.CompletionTokens
	if s.cfg.PromptTokensDetails {
		u.PromptTokensDetails = &promptTokensDetails{CachedTokens: res[0].cached, ExternalCachedTokens: res[0].external}
	}
	return u
}

// choices returns the sequences to return, in order: all of them, or for best_of > n the n with
// the highest cumulative logprob.
func choices(j *job, res []*seqResult) []int {
	idx := make([]int, len(res))
	for i := range idx {
		idx[i] = i
	}
	if j.p.bestOf > j.p.n {
		slices.SortStableFunc(idx, func(a, b int) int { return cmp.Compare(res[b].cumLogprob, res[a].cumLogprob) })
		idx = idx[:j.p.n]
	}
	return idx
}

// completionText returns what a completions choice shows of sequence r: the echoed prompt, then
// the generated text, with the logprobs of those tokens (nil where there are none).
func (j *job) completionText(r *seqResult, text string, tokens []int32, lps []model.PositionLogprobs, withPrompt bool) (string, []int32, []*model.PositionLogprobs) {
	var toks []int32
	var pos []*model.PositionLogprobs
	if withPrompt && j.echo {
		text = j.echoText + text
		toks = append(toks, j.prompt...)
		pos = append(pos, nil)
		for k := range r.prompt {
			pos = append(pos, &r.prompt[k])
		}
		for len(pos) < len(toks) {
			pos = append(pos, nil)
		}
		if j.noGeneration {
			return j.echoText, toks, pos
		}
	}
	toks = append(toks, tokens...)
	for k := range tokens {
		var p *model.PositionLogprobs
		if k < len(lps) {
			p = &lps[k]
		}
		pos = append(pos, p)
	}
	return text, toks, pos
}

// serve runs the job and writes the JSON or SSE response; release gives back the request's
// concurrency slots (called once the engine has ended every sequence). It reports whether the
// engine took the request (from then on the engine and its connector own its
// kv_transfer_params).
func (s *Server) serve(w http.ResponseWriter, r *http.Request, j *job, release func()) bool {
	ctx := r.Context()
	rn, taken, apiErr := s.startJob(ctx, j, release)
	if apiErr != nil {
		writeError(w, apiErr)
		return taken
	}
	defer rn.close()
	if j.p.stream {
		s.stream(w, j, rn)
		return true
	}
	apiErr, err := rn.wait(nil)
	switch {
	case err != nil:
		return true // the client is gone
	case apiErr != nil:
		writeError(w, apiErr)
		return true
	}
	res := rn.res
	idx := choices(j, res)
	u := s.usage(j, res, idx)
	tok := s.model.Tokenizer()
	var body any
	if j.chat {
		resp := chatResponse{ID: j.id, Object: "chat.completion", Created: j.created, Model: j.model,
			Choices: make([]chatChoice, 0, len(idx)), Usage: &u, KVTransferParams: res[0].kv}
		for k, i := range idx {
			fin := res[i].finish
			c := chatChoice{Index: k, Message: chatMessage{Role: "assistant", Content: j.chatEcho + string(res[i].text), ToolCalls: []any{}}, FinishReason: &fin}
			if j.p.logprobs {
				c.Logprobs = newChatLogprobs(tok, res[i].logprobs, j.p.topLogprobs)
			}
			resp.Choices = append(resp.Choices, c)
		}
		if j.p.promptLogprobs {
			resp.PromptLogprobs = &promptLogprobs{tok: tok, positions: res[0].prompt}
		}
		body = resp
	} else {
		resp := completionResponse{ID: j.id, Object: "text_completion", Created: j.created, Model: j.model,
			Choices: make([]completionChoice, 0, len(idx)), Usage: &u, KVTransferParams: res[0].kv}
		for k, i := range idx {
			r := res[i]
			fin := r.finish
			text, toks, pos := j.completionText(r, string(r.text), r.tokens, r.logprobs, true)
			c := completionChoice{Index: k, Text: text, FinishReason: &fin}
			if j.p.logprobs {
				c.Logprobs = newCompletionLogprobs(tok, toks, pos, j.p.topLogprobs, 0)
			}
			if j.p.promptLogprobs {
				c.PromptLogprobs = &promptLogprobs{tok: tok, positions: r.prompt}
			}
			resp.Choices = append(resp.Choices, c)
		}
		body = resp
	}
	writeJSON(w, http.StatusOK, body)
	return true
}

// includeUsage reports whether a stream ends with the usage chunk and whether every chunk
// carries usage, as vLLM's should_include_usage decides (stream_options {} asks for usage;
// --enable-force-include-usage always does).
func (s *Server) includeUsage(p genParams) (final, continuous bool) {
	if p.streamOptions {
		final = p.includeUsage || s.cfg.ForceIncludeUsage
		return final, final && p.continuousUsage
	}
	return s.cfg.ForceIncludeUsage, false
}

// stream writes the job's outputs as SSE chunks: (chat) a first chunk with the assistant role
// for every choice, text deltas (with their logprobs), each choice's chunk with finish_reason —
// the first one's also carries the engine's kv_transfer_params, when there are some, as a
// top-level field beside choices — a usage chunk (choices: []) when asked for, then [DONE].
// Every chunk but the usage one has a choice, so clients that read choices[0] of every event
// (vLLM's multi-turn benchmark) can parse the stream. A failure after the headers went out is
// one error event then [DONE].
func (s *Server) stream(w http.ResponseWriter, j *job, rn *runner) {
	sse := newSSEWriter(w)
	sse.start()
	tok := s.model.Tokenizer()
	final, continuous := s.includeUsage(j.p)
	usageFor := func(r *seqResult) *usageInfo {
		if continuous {
			u := r.usage
			return &u
		}
		return nil
	}
	if j.chat {
		empty := ""
		for i := range j.p.n {
			sse.event(chatChunk{ID: j.id, Object: "chat.completion.chunk", Created: j.created, Model: j.model,
				Choices: []chatChunkChoice{{Index: i, Delta: chatDelta{Role: "assistant", Content: &empty}}}})
			if j.chatEcho != "" {
				sse.event(chatChunk{ID: j.id, Object: "chat.completion.chunk", Created: j.created, Model: j.model,
					Choices: []chatChunkChoice{{Index: i, Delta: chatDelta{Content: &j.chatEcho}}}})
			}
		}
	}
	each := func(i int, o engine.Output) {
		r := rn.res[i]
		var fin *string
		if o.Finished {
			fin = &r.finish
		}
		if j.chat {
			text := o.Text
			if text == "" && fin == nil && !(j.p.logprobs && len(o.Tokens) > 0) {
				return
			}
			c := chatChunkChoice{Index: i, Delta: chatDelta{Content: &text}, FinishReason: fin}
			if j.p.logprobs {
				c.Logprobs = newChatLogprobs(tok, o.Logprobs, j.p.topLogprobs)
			}
			sse.event(chatChunk{ID: j.id, Object: "chat.completion.chunk", Created: j.created, Model: j.model,
				Choices: []chatChunkChoice{c}, Usage: usageFor(r), KVTransferParams: o.KVTransfer})
			return
		}
		text, toks, pos := j.completionText(r, o.Text, o.Tokens, o.Logprobs, !r.echoed)
		r.echoed = true
		if text == "" && fin == nil && !(j.p.logprobs && len(toks) > 0) {
			return
		}
		c := completionChunkChoice{Index: i, Text: text, FinishReason: fin}
		if j.p.logprobs {
			c.Logprobs = newCompletionLogprobs(tok, toks, pos, j.p.topLogprobs, r.sentRunes)
		}
		r.sentRunes += utf8.RuneCountInString(text) // Python's len(): characters
		sse.event(completionChunk{ID: j.id, Object: "text_completion", Created: j.created, Model: j.model,
			Choices: []completionChunkChoice{c}, Usage: usageFor(r), KVTransferParams: o.KVTransfer})
	}
	apiErr, err := rn.wait(each)
	switch {
	case err != nil:
		return
	case apiErr != nil:
		sse.raw(apiErr.JSON())
		sse.done()
		return
	}
	if final {
		object := "text_completion"
		if j.chat {
			object = "chat.completion.chunk"
		}
		all := make([]int, len(rn.res))
		for i := range all {
			all[i] = i
		}
		u := s.usage(j, rn.res, all)
		sse.event(usageChunk{ID: j.id, Object: object, Created: j.created, Model: j.model,
			Choices: []struct{}{}, Usage: &u})
	}
	sse.done()
}

// usageChunk is the chunk with empty choices that carries the usage.
type usageChunk struct {
	ID      string     `json:"id"`
	Object  string     `json:"object"`
	Created int64      `json:"created"`
	Model   string     `json:"model"`
	Choices []struct{} `json:"choices"`
	Usage   *usageInfo `json:"usage"`
}
