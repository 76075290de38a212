package engine

import "github.com/kvbridge/kvbridge/model"

// Output is one delivery on a request's Stream: the tokens sampled since the previous Output and
// their text, and on the last one (Finished) the finish reason and, where set, the connector's
// params or the error.
type Output struct {
	// Tokens are the new token ids (several when deliveries were coalesced for a slow reader).
	Tokens []int32
	// Text is the text delta of Tokens. Text that could be the start of a stop string is held
	// back until it is known not to be; a stop string and what follows are never emitted. The
	// text of an EOS or stop token id is not emitted.
	Text string
	// Finished marks the last Output of the stream.
	Finished bool
	// FinishReason is FinishStop, FinishLength, FinishAbort or FinishError on the last Output.
	FinishReason FinishReason
	// PromptTokens, CachedTokens and CompletionTokens are the usage counts so far: CachedTokens
	// is the prompt tokens not computed here (prefix-cache hit plus tokens loaded by the
	// connector), CompletionTokens the tokens generated so far.
	PromptTokens, CachedTokens, CompletionTokens int
	// ExternalCachedTokens is the part of CachedTokens loaded by the connector from a remote
	// engine; the rest came from the local prefix cache.
	ExternalCachedTokens int
	// Logprobs holds, for a request that asked for them, the logprobs of each of Tokens.
	Logprobs []model.PositionLogprobs
	// PromptLogprobs holds, for a request that asked for them, the logprobs of prompt tokens
	// 1..n-1 (entry k is prompt token k+1's); it comes once, with the first token.
	PromptLogprobs []model.PositionLogprobs
	// KVTransfer is the connector's kv_transfer_params, on the last Output, when it returned some.
	KVTransfer map[string]any
	// Err is set on the last Output of a request that ended with FinishError (wrapping ErrForward
	// or ErrKVLoad) or FinishAbort (ErrAborted, or ErrClosed when the engine closed).
	Err error
}

// maxStreamBuffer bounds a stream's channel; slower readers get coalesced Outputs.
const maxStreamBuffer = 64

// Stream carries one request's Outputs. Only the engine's step loop sends; it never blocks: when
// the reader falls behind, new tokens are merged into one pending Output that goes out with the
// next delivery, and one slot is always kept free for the final Output, after which the channel
// is closed.
type Stream struct {
	id      string
	ch      chan Output
	pending *Output // coalesced, not yet delivered (step loop only)
}

func newStream(id string, maxOutputs int) *Stream {
	return &Stream{id: id, ch: make(chan Output, min(max(maxOutputs, 1), maxStreamBuffer)+1)}
}

// ID returns the request id (the engine's when the request had none).
func (s *Stream) ID() string { return s.id }

// C returns the channel of Outputs. It is closed after the Output with Finished set. Cancel the
// context given to Add to abandon the request.
func (s *Stream) C() <-chan Output { return s.ch }

// send delivers a non-final Output, or merges it into the pending one when the reader is behind.
func (s *Stream) send(o Output) {
	if s.pending != nil {
		merge(s.pending, o)
		o, s.pending = *s.pending, nil
	}
	if len(s.ch) < cap(s.ch)-1 {
		s.ch <- o
		return
	}
	s.pending = &o
}

// finish delivers the final Output (merged with anything pending) and closes the channel.
func (s *Stream) finish(o Output) {
	o.Finished = true
	if s.pending != nil {
		merge(s.pending, o)
		o, s.pending = *s.pending, nil
	}
	s.ch <- o // a slot is always free: send keeps one
	close(s.ch)
}

// merge appends later Output o to p.
func merge(p *Output, o Output) {
	p.Tokens = append(p.Tokens, o.Tokens...)
	p.Logprobs = append(p.Logprobs, o.Logprobs...)
	if o.PromptLogprobs != nil {
		p.PromptLogprobs = o.PromptLogprobs
	}
	p.Text += o.Text
	p.Finished, p.FinishReason = o.Finished, o.FinishReason
	p.PromptTokens, p.CachedTokens, p.CompletionTokens = o.PromptTokens, o.CachedTokens, o.CompletionTokens
	if o.KVTransfer != nil {
		p.KVTransfer = o.KVTransfer
	}
	if o.Err != nil {
		p.Err = o.Err
	}
}
