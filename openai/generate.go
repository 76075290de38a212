package openai

import (
	"context"
	"errors"
	"net/http"
	"time"

	"github.com/google/uuid"

	"github.com/kvbridge/kvbridge/engine"
)

// abortGrace bounds the wait for the engine's final output after the client went away.
const abortGrace = 10 * time.Second

// errClientGone reports that the client disconnected; nothing more can be written.
var errClientGone = errors.New("openai: client disconnected")

// job is one generation: the engine request and how to present its outputs.
type job struct {
	chat    bool
	id      string // response id: cmpl-<base> or chatcmpl-<base>
	created int64
	model   string
	req     *engine.Request
	p       genParams
	echo    string // with echo: the prompt text (completions) or final assistant message (chat) to prepend
}

// outcome is what a successfully finished request produced.
type outcome struct {
	text       string
	finish     string
	usage      usageInfo
	kvTransfer map[string]any
}

// deltaFunc receives the text of each output as it arrives (streaming); final is set on the
// last call, with the finish reason.
type deltaFunc func(text string, final bool, finish string, u usageInfo)

// engineID returns a unique engine request id for a response id: vLLM appends a random suffix
// to external ids so that a reused X-Request-Id never collides inside the engine.
func engineID(prefix string) string { return prefix + "-" + uuid.NewString()[:8] }

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

// add queues the job's request in the engine.
func (s *Server) add(ctx context.Context, j *job) (*engine.Stream, *APIError) {
	st, err := s.engine.Add(ctx, j.req)
	if err != nil {
		return nil, s.addError(err)
	}
	return st, nil
}

// collect reads the request's outputs until it finishes, recording metrics and calling onDelta
// (if non-nil) for every piece of text. It returns errClientGone if the client went away, or
// an APIError for a request that ended in error.
func (s *Server) collect(ctx context.Context, j *job, st *engine.Stream, onDelta deltaFunc) (outcome, *APIError, error) {
	var (
		out      outcome
		text     []byte
		start    = time.Now()
		last     time.Time
		gotToken bool
		ch       = st.C()
		done     = ctx.Done()
		grace    <-chan time.Time
	)
	out.usage.PromptTokens = len(j.req.Prompt)
	completion := 0
	for {
		select {
		case <-done:
			done = nil
			t := time.NewTimer(abortGrace)
			defer t.Stop()
			grace = t.C
			continue
		case <-grace:
			s.log.Warn("engine did not finish an aborted request in time", "request_id", j.req.ID)
			return out, nil, errClientGone
		case o, ok := <-ch:
			if !ok {
				s.log.Error("engine stream closed before the request finished", "request_id", j.req.ID)
				return out, internalError(), nil
			}
			now := time.Now()
			if n := len(o.Tokens); n > 0 {
				// One inter-token latency per token after the first, as vLLM records per step;
				// an Output coalescing n tokens spreads its gap over them.
				if !gotToken {
					gotToken = true
					s.metrics.ObserveTimeToFirstToken(now.Sub(start))
					s.metrics.AddPromptTokens(max(o.PromptTokens, len(j.req.Prompt)))
					for range n - 1 {
						s.metrics.ObserveInterTokenLatency(0)
					}
				} else {
					gap := now.Sub(last) / time.Duration(n)
					for range n {
						s.metrics.ObserveInterTokenLatency(gap)
					}
				}
				last = now
				s.metrics.AddGenerationTokens(n)
				completion += n
			}
			if o.PromptTokens > 0 {
				out.usage.PromptTokens = o.PromptTokens
			}
			if o.CachedTokens > 0 {
				out.usage.PromptTokensDetails.CachedTokens = o.CachedTokens
				out.usage.PromptTokensDetails.ExternalCachedTokens = o.ExternalCachedTokens
			}
			out.usage.CompletionTokens = max(o.CompletionTokens, completion)
			out.usage.TotalTokens = out.usage.PromptTokens + out.usage.CompletionTokens
			text = append(text, o.Text...)

			if !o.Finished {
				if onDelta != nil && o.Text != "" {
					onDelta(o.Text, false, "", out.usage)
				}
				continue
			}
			s.metrics.ObserveFinished(o.FinishReason, now.Sub(start))
			switch o.FinishReason {
			case "stop", "length":
			case "abort":
				if ctx.Err() != nil {
					return out, nil, errClientGone
				}
				if errors.Is(o.Err, engine.ErrClosed) {
					return out, unavailable(), nil
				}
				s.log.Error("request aborted by the engine", "request_id", j.req.ID, "err", o.Err)
				return out, internalError(), nil
			default: // "error": forward failure, KV load failure under policy fail, …
				s.log.Error("request failed", "request_id", j.req.ID, "finish_reason", o.FinishReason, "err", o.Err)
				return out, internalError(), nil
			}
			out.text = string(text)
			out.finish = o.FinishReason
			out.kvTransfer = o.KVTransfer
			if onDelta != nil {
				onDelta(o.Text, true, o.FinishReason, out.usage)
			}
			return out, nil, nil
		}
	}
}

// serve runs the job and writes the JSON or SSE response.
func (s *Server) serve(w http.ResponseWriter, r *http.Request, j *job) {
	ctx := r.Context()
	st, apiErr := s.add(ctx, j)
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	if j.p.stream {
		s.stream(ctx, w, j, st)
		return
	}
	out, apiErr, err := s.collect(ctx, j, st, nil)
	switch {
	case err != nil:
		return // the client is gone
	case apiErr != nil:
		writeError(w, apiErr)
		return
	}
	fin := out.finish
	var body any
	if j.chat {
		body = chatResponse{
			ID: j.id, Object: "chat.completion", Created: j.created, Model: j.model,
			Choices: []chatChoice{{
				Message:      chatMessage{Role: "assistant", Content: j.echo + out.text, ToolCalls: []any{}},
				FinishReason: &fin,
			}},
			Usage:            &out.usage,
			KVTransferParams: out.kvTransfer,
		}
	} else {
		body = completionResponse{
			ID: j.id, Object: "text_completion", Created: j.created, Model: j.model,
			Choices:          []completionChoice{{Text: j.echo + out.text, FinishReason: &fin}},
			Usage:            &out.usage,
			KVTransferParams: out.kvTransfer,
		}
	}
	writeJSON(w, http.StatusOK, body)
}

// stream writes the job's outputs as SSE chunks: (chat) a first chunk with the assistant role,
// text deltas, the chunk with finish_reason, a kv_transfer_params chunk when the engine returned
// params, a usage chunk with stream_options.include_usage, then [DONE]. A failure after the
// headers went out is one error event then [DONE].
func (s *Server) stream(ctx context.Context, w http.ResponseWriter, j *job, st *engine.Stream) {
	sse := newSSEWriter(w)
	sse.start()
	usageFor := func(u usageInfo) *usageInfo {
		if j.p.continuousUsage {
			return &u
		}
		return nil
	}
	if j.chat {
		empty := ""
		sse.event(chatChunk{ID: j.id, Object: "chat.completion.chunk", Created: j.created, Model: j.model,
			Choices: []chatChunkChoice{{Delta: chatDelta{Role: "assistant", Content: &empty}}}})
		if j.echo != "" {
			sse.event(chatChunk{ID: j.id, Object: "chat.completion.chunk", Created: j.created, Model: j.model,
				Choices: []chatChunkChoice{{Delta: chatDelta{Content: &j.echo}}}})
		}
	} else if j.echo != "" {
		sse.event(completionChunk{ID: j.id, Object: "text_completion", Created: j.created, Model: j.model,
			Choices: []completionChoice{{Text: j.echo}}})
	}
	onDelta := func(text string, final bool, finish string, u usageInfo) {
		var fin *string
		if final {
			fin = &finish
		}
		if j.chat {
			sse.event(chatChunk{ID: j.id, Object: "chat.completion.chunk", Created: j.created, Model: j.model,
				Choices: []chatChunkChoice{{Delta: chatDelta{Content: &text}, FinishReason: fin}}, Usage: usageFor(u)})
		} else {
			sse.event(completionChunk{ID: j.id, Object: "text_completion", Created: j.created, Model: j.model,
				Choices: []completionChoice{{Text: text, FinishReason: fin}}, Usage: usageFor(u)})
		}
	}
	out, apiErr, err := s.collect(ctx, j, st, onDelta)
	switch {
	case err != nil:
		return
	case apiErr != nil:
		sse.raw(apiErr.JSON())
		sse.done()
		return
	}
	object := "text_completion"
	if j.chat {
		object = "chat.completion.chunk"
	}
	if out.kvTransfer != nil {
		sse.event(finalChunk{ID: j.id, Object: object, Created: j.created, Model: j.model,
			Choices: []struct{}{}, KVTransferParams: out.kvTransfer})
	}
	if j.p.includeUsage {
		sse.event(finalChunk{ID: j.id, Object: object, Created: j.created, Model: j.model,
			Choices: []struct{}{}, Usage: &out.usage})
	}
	sse.done()
}

// finalChunk is a chunk with empty choices that carries kv_transfer_params or usage.
type finalChunk struct {
	ID               string         `json:"id"`
	Object           string         `json:"object"`
	Created          int64          `json:"created"`
	Model            string         `json:"model"`
	Choices          []struct{}     `json:"choices"`
	Usage            *usageInfo     `json:"usage,omitempty"`
	KVTransferParams map[string]any `json:"kv_transfer_params,omitempty"`
}
