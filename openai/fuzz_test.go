package openai

import (
	"net/http"
	"net/http/httptest"
	"testing"
)

// FuzzDecodeRequest feeds arbitrary bodies through decoding and validation of both routes (no
// generation): it must never panic, and a rejected body must get a 4xx APIError whose JSON is
// well formed.
func FuzzDecodeRequest(f *testing.F) {
	f.Add([]byte(`{"model":"tiny","prompt":"Hello","max_tokens":4}`), false)
	f.Add([]byte(`{"prompt":[1,2,3],"stream":true,"stream_options":{"include_usage":true}}`), false)
	f.Add([]byte(`{"prompt":[[1,2]],"stop":["a","b"],"kv_transfer_params":{"do_remote_decode":true}}`), false)
	f.Add([]byte(`{"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"max_completion_tokens":1.0}`), true)
	f.Add([]byte(`{"messages":[{"role":"user","content":null}],"n":2}`), true)
	f.Add([]byte(`{"messages":[{"role":"user","content":"x"}],"temperature":-1,"top_k":-2}`), true)
	f.Add([]byte(`[1,2,3]`), true)
	f.Add([]byte(`{"prompt":`), false)
	e := newEnv(f)
	s := e.server
	f.Fuzz(func(t *testing.T, body []byte, chat bool) {
		w := httptest.NewRecorder()
		r := httptest.NewRequest(http.MethodPost, "/v1/completions", nil)
		var (
			j      *job
			apiErr *APIError
		)
		if chat {
			j, apiErr = s.chatJob(w, r, body)
		} else {
			j, apiErr = s.completionJob(w, r, body)
		}
		if apiErr != nil {
			if apiErr.Status < 400 || apiErr.Status > 499 {
				t.Fatalf("status %d for %q", apiErr.Status, body)
			}
			errorOf(t, apiErr.JSON(), apiErr.Status)
			return
		}
		if j == nil || len(j.reqs) == 0 || len(j.reqs) > maxChoices {
			t.Fatalf("accepted an invalid request %q: %+v", body, j)
		}
		for _, req := range j.reqs {
			if len(req.Prompt) == 0 || req.MaxTokens < 1 ||
				len(req.Prompt)+req.MaxTokens > testMaxModelLen || req.MinTokens > req.MaxTokens {
				t.Fatalf("accepted an invalid request %q: %+v", body, req)
			}
		}
	})
}
