// Package apiclient is a client of kvbridge's OpenAI-compatible HTTP API, as the benchmarks, the
// demo, the soak and the fault suite use it: Post sends a completion or chat completion and reads
// the answer to its end, streamed (server-sent events) or not, and Reply says what a client saw —
// status, headers, text, finish reason, kv_transfer_params, the error object, usage — and when
// the first content and the end arrived. See docs/architecture.md for where the package sits.
package apiclient

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

// Reply is what one request's client saw.
type Reply struct {
	// Status and Header are the response's.
	Status int
	Header http.Header
	// Raw is the body as received (the whole event stream when streamed).
	Raw []byte
	// Streamed says the answer was an event stream (Content-Type text/event-stream); Done that
	// the stream ended with "data: [DONE]".
	Streamed, Done bool
	// Text is the content of every choice, in order: completions' text, chat messages' content
	// and chat deltas' content.
	Text string
	// Role is the role of the first chat message or delta that names one ("assistant").
	Role string
	// FinishReason is the last finish_reason seen.
	FinishReason string
	// Error is the error object of an error answer or of an event in the stream.
	Error map[string]any
	// KVTransferParams is the last kv_transfer_params seen.
	KVTransferParams map[string]any
	// PromptTokens and CompletionTokens are the usage, when the answer carries it.
	PromptTokens, CompletionTokens int
	// Chunks counts the events that carried content; FirstChunk is the first one's content.
	Chunks     int
	FirstChunk string
	// Malformed describes a body or an event that is not JSON ("" when all were).
	Malformed string
	// TTFT runs from sending the request to the first content (to the end of the body when no
	// content came, and always for an answer that is not streamed); Latency to the end of the
	// body.
	TTFT, Latency time.Duration
}

// Post sends body to url as JSON (a []byte is sent as it is), with header's fields added, and
// reads the answer to its end. The error is non-nil only when the request could not be sent or
// its body not read to the end; the Reply then holds what had arrived. An answer that arrived is
// not an error, whatever it says: see Check.
func Post(ctx context.Context, hc *http.Client, url string, body any, header http.Header) (Reply, error) {
	return PostWatching(ctx, hc, url, body, header, nil)
}

// PostWatching is Post, calling onContent (when not nil) on the reading goroutine after each
// event of a stream that carried content, with the reply so far: a test acts on a stream in
// flight with it.
func PostWatching(ctx context.Context, hc *http.Client, url string, body any, header http.Header, onContent func(Reply)) (Reply, error) {
	data, ok := body.([]byte)
	if !ok {
		var err error
		if data, err = json.Marshal(body); err != nil {
			return Reply{}, fmt.Errorf("apiclient: encoding the request: %w", err)
		}
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(data))
	if err != nil {
		return Reply{}, fmt.Errorf("apiclient: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, vs := range header {
		req.Header[k] = vs
	}
	start := time.Now()
	resp, err := hc.Do(req)
	if err != nil {
		return Reply{}, err
	}
	defer resp.Body.Close()
	r := Reply{Status: resp.StatusCode, Header: resp.Header, Streamed: strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream")}
	if !r.Streamed {
		r.Raw, err = io.ReadAll(resp.Body)
		r.Latency = time.Since(start)
		r.TTFT = r.Latency
		if err != nil {
			return r, fmt.Errorf("apiclient: reading the answer of %s after %d bytes: %w", url, len(r.Raw), err)
		}
		r.event(r.Raw)
		return r, nil
	}
	var raw bytes.Buffer
	br := bufio.NewReaderSize(resp.Body, 64<<10)
	for {
		line, err := br.ReadBytes('\n')
		raw.Write(line)
		if payload, ok := bytes.CutPrefix(bytes.TrimRight(line, "\r\n"), []byte("data:")); ok {
			payload = bytes.TrimLeft(payload, " ")
			if bytes.Equal(payload, []byte("[DONE]")) {
				r.Done = true
			} else if text := r.event(payload); text != "" {
				if r.Chunks == 1 {
					r.TTFT = time.Since(start)
				}
				if onContent != nil {
					onContent(r)
				}
			}
		}
		if err != nil {
			r.Raw, r.Latency = raw.Bytes(), time.Since(start)
			if r.Chunks == 0 {
				r.TTFT = r.Latency
			}
			if errors.Is(err, io.EOF) {
				return r, nil
			}
			return r, fmt.Errorf("apiclient: reading the stream of %s: %w", url, err)
		}
	}
}

// answer is the part of an answer or of an event that Reply records.
type answer struct {
	Choices []struct {
		Text    string   `json:"text"`
		Message *message `json:"message"`
		Delta   *message `json:"delta"`
		Finish  *string  `json:"finish_reason"`
	} `json:"choices"`
	Error            map[string]any `json:"error"`
	KVTransferParams map[string]any `json:"kv_transfer_params"`
	Usage            *struct {
		PromptTokens     int `json:"prompt_tokens"`
		CompletionTokens int `json:"completion_tokens"`
	} `json:"usage"`
}

type message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// event records one JSON answer or event and returns the content it carried.
func (r *Reply) event(data []byte) string {
	var a answer
	if err := json.Unmarshal(data, &a); err != nil {
		if r.Malformed == "" {
			r.Malformed = fmt.Sprintf("not JSON (%v): %.200q", err, data)
		}
		return ""
	}
	if a.Error != nil {
		r.Error = a.Error
	}
	if a.KVTransferParams != nil {
		r.KVTransferParams = a.KVTransferParams
	}
	if a.Usage != nil {
		r.PromptTokens, r.CompletionTokens = a.Usage.PromptTokens, a.Usage.CompletionTokens
	}
	var text string
	for _, c := range a.Choices {
		text += c.Text
		for _, m := range []*message{c.Message, c.Delta} {
			if m != nil {
				text += m.Content
				if r.Role == "" {
					r.Role = m.Role
				}
			}
		}
		if c.Finish != nil && *c.Finish != "" {
			r.FinishReason = *c.Finish
		}
	}
	if text != "" {
		if r.Chunks == 0 {
			r.FirstChunk = text
		}
		r.Chunks++
		r.Text += text
	}
	return text
}

// StatusError is an answer whose status is not 200.
type StatusError struct {
	URL    string
	Status int
	Body   []byte
}

func (e *StatusError) Error() string {
	return fmt.Sprintf("POST %s answered %d: %.300s", e.URL, e.Status, e.Body)
}

// ErrAnswer marks a 200 answer that is not a whole answer: an error event, a body or event that
// is not JSON, a stream without [DONE].
var ErrAnswer = errors.New("apiclient: not a whole answer")

// Check returns nil for a whole, successful answer from url: status 200, no error object, only
// JSON, and a stream that ended with [DONE]. Otherwise it returns a *StatusError or an error
// wrapping ErrAnswer.
func (r Reply) Check(url string) error {
	switch {
	case r.Status != http.StatusOK:
		return &StatusError{URL: url, Status: r.Status, Body: r.Raw}
	case r.Error != nil:
		return fmt.Errorf("%w: %s sent an error: %v", ErrAnswer, url, r.Error["message"])
	case r.Malformed != "":
		return fmt.Errorf("%w: %s sent a body %s", ErrAnswer, url, r.Malformed)
	case r.Streamed && !r.Done:
		return fmt.Errorf("%w: the stream of %s ended without [DONE]", ErrAnswer, url)
	}
	return nil
}
