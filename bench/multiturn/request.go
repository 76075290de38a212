package multiturn

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/kvbridge/kvbridge/apiclient"
)

// chatPayload is the body of one /v1/chat/completions request. Field order is the order on the
// wire: the current vLLM script's (model, messages, conversation_id, stream, stream_options,
// max_tokens), then what only kvbridge sends when asked (seed, temperature, min_tokens).
type chatPayload struct {
	Model          string         `json:"model"`
	Messages       []Message      `json:"messages"`
	ConversationID string         `json:"conversation_id,omitempty"`
	Stream         bool           `json:"stream,omitempty"`
	StreamOptions  *streamOptions `json:"stream_options,omitempty"`
	MaxTokens      *int           `json:"max_tokens,omitempty"`
	Seed           *int64         `json:"seed,omitempty"`
	Temperature    *float64       `json:"temperature,omitempty"`
	MinTokens      *int           `json:"min_tokens,omitempty"`
}

// streamOptions is the OpenAI stream_options object.
type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

// serverResponse is one request's timings and text.
type serverResponse struct {
	start      time.Time
	ttft       time.Duration // to the first content chunk (the whole response when not streaming)
	latency    time.Duration // to [DONE] (to the end of the body when not streaming)
	firstChunk string
	content    string
	// chunks counts the content chunks after the first one, as vLLM's benchmark does.
	chunks int
}

// errRejected marks a response that arrived but is not a usable answer (an HTTP error status, a
// stream without content). The conversation is dropped; the client goes on.
var errRejected = errors.New("request rejected")

// requester sends chat requests.
type requester struct {
	http     *http.Client
	chatURL  string
	model    string
	stream   bool
	timeout  time.Duration
	header   http.Header
	sendConv bool
	// seed, temperature and sendMinTokens add what the current vLLM script no longer sends.
	seed          *int64
	temperature   *float64
	sendMinTokens bool
}

// send posts messages and reads the answer. It returns errRejected (wrapped) for an answer that
// is not usable, another error when the request failed (timeout, connection).
func (q *requester) send(ctx context.Context, convID string, messages []Message, minTokens, maxTokens *int) (serverResponse, error) {
	body := chatPayload{Model: q.model, Messages: messages, MaxTokens: maxTokens, Seed: q.seed, Temperature: q.temperature}
	if q.sendMinTokens {
		body.MinTokens = minTokens
	}
	if q.sendConv {
		body.ConversationID = convID
	}
	if q.stream {
		body.Stream = true
		body.StreamOptions = &streamOptions{IncludeUsage: false}
	}
	timeout := q.timeout
	if maxTokens != nil {
		// Assume at most 200 ms per output token, as the original does.
		if t := time.Duration(*maxTokens/5) * time.Second; t > timeout {
			timeout = t
		}
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	header := http.Header{}
	if q.sendConv {
		header.Set("X-Session-ID", convID)
	}
	for k, vs := range q.header {
		header[k] = vs
	}
	start := time.Now()
	a, err := apiclient.Post(ctx, q.http, q.chatURL, body, header)
	r := serverResponse{start: start, ttft: a.TTFT, latency: a.Latency, firstChunk: a.FirstChunk, content: a.Text, chunks: max(a.Chunks-1, 0)}
	if err != nil {
		return r, timeoutErr(ctx, timeout, err)
	}
	if a.Status != http.StatusOK {
		return r, fmt.Errorf("%w: HTTP %d: %s", errRejected, a.Status, strings.TrimSpace(string(a.Raw[:min(len(a.Raw), 4096)])))
	}
	switch {
	case a.Malformed != "":
		return r, fmt.Errorf("%w: the answer is %s", errRejected, a.Malformed)
	case a.Error != nil:
		return r, fmt.Errorf("%w: error in the answer: %v", errRejected, a.Error["message"])
	case !q.stream && a.Role != "assistant":
		return r, fmt.Errorf("%w: response has no assistant message", errRejected)
	case q.stream && a.Chunks == 0:
		return r, fmt.Errorf("%w: the stream carried no content", errRejected)
	}
	if !q.stream {
		r.chunks = 0
	}
	return r, nil
}

// timeoutErr explains a failed request, naming the timeout when it expired.
func timeoutErr(ctx context.Context, timeout time.Duration, err error) error {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return fmt.Errorf("request timed out after %v (--request-timeout-sec; raised to max_tokens×0.2 s when larger): %w", timeout, err)
	}
	return err
}

// shorten abbreviates long text for messages, as the original does: the first and last 20
// characters of text of 400 or more.
func shorten(s string) string {
	r := []rune(s)
	if len(r) < 400 {
		return s
	}
	return string(r[:20]) + "..." + string(r[len(r)-20:])
}
