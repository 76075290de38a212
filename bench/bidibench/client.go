package bidibench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"
)

// chatMessage is one message of a conversation's history.
type chatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// chatReply is what one streamed chat turn told the client.
type chatReply struct {
	ttft, latency time.Duration // to the first content chunk; to the end of the stream
	text          string
	header        http.Header
	promptTokens  int // usage.prompt_tokens (D's count of the prompt)
	outputTokens  int // usage.completion_tokens
}

// errStatus reports an answer other than 200.
type errStatus struct {
	url    string
	status int
	body   []byte
}

func (e *errStatus) Error() string {
	b := e.body
	if len(b) > 300 {
		b = b[:300]
	}
	return fmt.Sprintf("bidibench: POST %s answered %d: %s", e.url, e.status, b)
}

// streamChat sends one streaming chat completion (or completion) and reads it to the end. The time to first
// token is taken at the first chunk with non-empty content, as a client sees it.
func streamChat(ctx context.Context, hc *http.Client, url string, body map[string]any) (chatReply, error) {
	var r chatReply
	data, err := json.Marshal(body)
	if err != nil {
		return r, fmt.Errorf("bidibench: %w", err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(data))
	if err != nil {
		return r, fmt.Errorf("bidibench: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	t0 := time.Now()
	resp, err := hc.Do(req)
	if err != nil {
		return r, fmt.Errorf("bidibench: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return r, &errStatus{url: url, status: resp.StatusCode, body: b}
	}
	r.header = resp.Header
	br := bufio.NewReaderSize(resp.Body, 64<<10)
	for {
		line, err := br.ReadBytes('\n')
		if payload, ok := bytes.CutPrefix(bytes.TrimRight(line, "\r\n"), []byte("data: ")); ok && !bytes.Equal(payload, []byte("[DONE]")) {
			var ev struct {
				Choices []struct {
					Delta struct {
						Content string `json:"content"`
					} `json:"delta"`
					Text string `json:"text"` // completions
				} `json:"choices"`
				Usage *struct {
					PromptTokens     int `json:"prompt_tokens"`
					CompletionTokens int `json:"completion_tokens"`
				} `json:"usage"`
				Error *struct {
					Message string `json:"message"`
				} `json:"error"`
			}
			if jerr := json.Unmarshal(payload, &ev); jerr != nil {
				return r, fmt.Errorf("bidibench: bad event from %s: %q: %w", url, payload, jerr)
			}
			if ev.Error != nil {
				return r, fmt.Errorf("bidibench: %s streamed an error: %s", url, ev.Error.Message)
			}
			for _, c := range ev.Choices {
				text := c.Delta.Content + c.Text
				if text != "" && r.ttft == 0 {
					r.ttft = time.Since(t0)
				}
				r.text += text
			}
			if ev.Usage != nil {
				r.promptTokens, r.outputTokens = ev.Usage.PromptTokens, ev.Usage.CompletionTokens
			}
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			return r, fmt.Errorf("bidibench: reading the stream of %s: %w", url, err)
		}
	}
	r.latency = time.Since(t0)
	if r.ttft == 0 {
		r.ttft = r.latency // no content at all: the whole answer is the first token's wait
	}
	return r, nil
}

// headerInt reads an integer response header; -1 when absent or malformed.
func headerInt(h http.Header, k string) int {
	n, err := strconv.Atoi(h.Get(k))
	if err != nil {
		return -1
	}
	return n
}
