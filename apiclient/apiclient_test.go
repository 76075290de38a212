package apiclient_test

import (
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/kvbridge/kvbridge/apiclient"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/model"
)

// TestWire: answers written byte for byte as the OpenAI wire format has them (streamed and not,
// good and broken), and what a client must make of each.
func TestWire(t *testing.T) {
	const sse = "text/event-stream"
	for _, tc := range []struct {
		name, contentType, body string
		status                  int
		check                   func(t *testing.T, r apiclient.Reply, checkErr error)
	}{
		{"chat stream", sse, "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n" +
			"data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n" +
			": a comment line\n" +
			"data:{\"choices\":[{\"delta\":{\"content\":\"lo\"},\"finish_reason\":\"length\"}],\"kv_transfer_params\":{\"remote_port\":5600}}\n\n" +
			"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":2}}\n\n" +
			"data: [DONE]\n\n", 200,
			func(t *testing.T, r apiclient.Reply, err error) {
				if err != nil || !r.Streamed || !r.Done || r.Text != "Hello" || r.Role != "assistant" || r.FinishReason != "length" ||
					r.Chunks != 2 || r.FirstChunk != "Hel" || r.PromptTokens != 7 || r.CompletionTokens != 2 ||
					fmt.Sprint(r.KVTransferParams["remote_port"]) != "5600" || r.TTFT <= 0 || r.TTFT > r.Latency {
					t.Errorf("%v: %+v", err, r)
				}
			}},
		{"completion, not streamed", "application/json", `{"choices":[{"text":"abc","finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}`, 200,
			func(t *testing.T, r apiclient.Reply, err error) {
				if err != nil || r.Streamed || r.Text != "abc" || r.FinishReason != "stop" || r.Chunks != 1 || r.TTFT != r.Latency || r.CompletionTokens != 1 {
					t.Errorf("%v: %+v", err, r)
				}
			}},
		{"error answer", "application/json", `{"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}`, 500,
			func(t *testing.T, r apiclient.Reply, err error) {
				var se *apiclient.StatusError
				if !errors.As(err, &se) || se.Status != 500 || r.Error["type"] != "InternalServerError" {
					t.Errorf("%v: %+v", err, r)
				}
			}},
		{"error event in a 200 stream", sse, "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n" +
			"data: {\"error\":{\"message\":\"decode stream ended early\",\"code\":\"decode_request_failed\"}}\n\ndata: [DONE]\n\n", 200,
			func(t *testing.T, r apiclient.Reply, err error) {
				if !errors.Is(err, apiclient.ErrAnswer) || r.Error["code"] != "decode_request_failed" || r.Text != "a" {
					t.Errorf("%v: %+v", err, r)
				}
			}},
		{"stream cut before [DONE]", sse, "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n", 200,
			func(t *testing.T, r apiclient.Reply, err error) {
				if !errors.Is(err, apiclient.ErrAnswer) || r.Done {
					t.Errorf("%v: %+v", err, r)
				}
			}},
		{"an event that is not JSON", sse, "data: {\"choi\n\ndata: [DONE]\n\n", 200,
			func(t *testing.T, r apiclient.Reply, err error) {
				if !errors.Is(err, apiclient.ErrAnswer) || r.Malformed == "" || r.TTFT != r.Latency {
					t.Errorf("%v: %+v", err, r)
				}
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
				if req.Header.Get("X-Request-Id") != "id-1" || req.Header.Get("Content-Type") != "application/json" {
					http.Error(w, "headers missing", 400)
					return
				}
				w.Header().Set("Content-Type", tc.contentType)
				w.WriteHeader(tc.status)
				fmt.Fprint(w, tc.body)
			}))
			defer srv.Close()
			r, err := apiclient.Post(t.Context(), srv.Client(), srv.URL, map[string]any{"prompt": "x"}, http.Header{"X-Request-Id": {"id-1"}})
			if err != nil {
				t.Fatal(err)
			}
			if string(r.Raw) != tc.body {
				t.Errorf("raw body %q, sent %q", r.Raw, tc.body)
			}
			tc.check(t, r, r.Check(srv.URL))
		})
	}
}

// TestEngine: against a real engine, a streamed chat answer carries the same text as the same
// request not streamed (greedy), with usage when asked for.
func TestEngine(t *testing.T) {
	in, err := instance.Start(t.Context(), instance.Config{Model: model.Tiny, Host: "127.0.0.1", NumBlocks: 64, MaxModelLen: 512})
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	url := in.URL + "/v1/chat/completions"
	body := map[string]any{"model": model.Tiny, "messages": []map[string]any{{"role": "user", "content": "Say something."}},
		"max_tokens": 6, "temperature": 0, "ignore_eos": true}
	plain, err := apiclient.Post(t.Context(), http.DefaultClient, url, body, nil)
	if err != nil || plain.Check(url) != nil {
		t.Fatalf("%v %v: %s", err, plain.Check(url), plain.Raw)
	}
	body["stream"], body["stream_options"] = true, map[string]any{"include_usage": true}
	streamed, err := apiclient.Post(t.Context(), http.DefaultClient, url, body, nil)
	if err != nil || streamed.Check(url) != nil {
		t.Fatalf("%v %v: %s", err, streamed.Check(url), streamed.Raw)
	}
	if plain.Text == "" || streamed.Text != plain.Text || streamed.Role != "assistant" || plain.Role != "assistant" ||
		streamed.CompletionTokens != 6 || streamed.PromptTokens <= 0 || streamed.Chunks < 1 || streamed.FinishReason != "length" {
		t.Errorf("not streamed %+v\nstreamed %+v", plain, streamed)
	}
}
