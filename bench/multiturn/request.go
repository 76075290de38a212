package multiturn

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"
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

// chatResponse is the part of a response or stream chunk the benchmark reads.
type chatResponse struct {
	Choices []struct {
		Delta   *Message `json:"delta"`
		Message *Message `json:"message"`
	} `json:"choices"`
	Error *struct {
		Message string `json:"message"`
	} `json:"error"`
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
	p := chatPayload{Model: q.model, Messages: messages, MaxTokens: maxTokens, Seed: q.seed, Temperature: q.temperature}
	if q.sendMinTokens {
		p.MinTokens = minTokens
	}
	if q.sendConv {
		p.ConversationID = convID
	}
	if q.stream {
		p.Stream = true
		p.StreamOptions = &streamOptions{IncludeUsage: false}
	}
	body, err := json.Marshal(p)
	if err != nil {
		return serverResponse{}, fmt.Errorf("encoding request: %w", err)
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
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, q.chatURL, bytes.NewReader(body))
	if err != nil {
		return serverResponse{}, fmt.Errorf("building request: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	if q.sendConv {
		req.Header.Set("X-Session-ID", convID)
	}
	for k, vs := range q.header {
		req.Header[k] = vs
	}

	r := serverResponse{start: time.Now()}
	resp, err := q.http.Do(req)
	if err != nil {
		return r, timeoutErr(ctx, timeout, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return r, fmt.Errorf("%w: HTTP %d: %s", errRejected, resp.StatusCode, strings.TrimSpace(string(msg)))
	}
	if !q.stream {
		data, err := io.ReadAll(resp.Body)
		if err != nil {
			return r, timeoutErr(ctx, timeout, err)
		}
		r.latency = time.Since(r.start)
		r.ttft = r.latency
		var cr chatResponse
		if err := json.Unmarshal(data, &cr); err != nil {
			return r, fmt.Errorf("%w: response is not JSON: %w", errRejected, err)
		}
		if cr.Error != nil {
			return r, fmt.Errorf("%w: %s", errRejected, cr.Error.Message)
		}
		if len(cr.Choices) == 0 || cr.Choices[0].Message == nil || cr.Choices[0].Message.Role != "assistant" {
			return r, fmt.Errorf("%w: response has no assistant message", errRejected)
		}
		r.content = cr.Choices[0].Message.Content
		return r, nil
	}

	br := bufio.NewReaderSize(resp.Body, 64<<10)
	var (
		b        strings.Builder
		gotFirst bool
		done     bool
	)
	for !done {
		line, err := br.ReadString('\n')
		if err != nil && err != io.EOF {
			return r, timeoutErr(ctx, timeout, err)
		}
		eof := err == io.EOF
		now := time.Now()
		line = strings.TrimSpace(line)
		if data, ok := strings.CutPrefix(line, "data:"); ok {
			data = strings.TrimSpace(data)
			if data == "[DONE]" {
				r.latency = now.Sub(r.start)
				done = true
				continue
			}
			var cr chatResponse
			if err := json.Unmarshal([]byte(data), &cr); err != nil {
				return r, fmt.Errorf("%w: bad stream chunk %q: %w", errRejected, shorten(data), err)
			}
			if cr.Error != nil {
				return r, fmt.Errorf("%w: error in stream: %s", errRejected, cr.Error.Message)
			}
			if len(cr.Choices) > 0 && cr.Choices[0].Delta != nil && cr.Choices[0].Delta.Content != "" {
				text := cr.Choices[0].Delta.Content
				if !gotFirst {
					gotFirst = true
					r.ttft = now.Sub(r.start)
					r.firstChunk = text
				} else {
					r.chunks++
				}
				b.WriteString(text)
			}
		}
		if eof {
			break
		}
	}
	if r.latency == 0 {
		r.latency = time.Since(r.start)
	}
	r.content = b.String()
	if !gotFirst {
		return r, fmt.Errorf("%w: the stream carried no content", errRejected)
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
