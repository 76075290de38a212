package proxy

import (
	"bytes"
	"encoding/json"
	"net/http"
	"testing"
)

// TestUsageHeadersNeedDetails: the pulled/computed split is read from P's
// usage.prompt_tokens_details; a P that does not report it (started without
// --enable-prompt-tokens-details, vLLM's default) must not be shown as having pulled nothing
// and computed the whole prompt.
func TestUsageHeadersNeedDetails(t *testing.T) {
	for _, tc := range []struct {
		usage                    string
		prompt, pulled, computed string
	}{
		{`{"prompt_tokens":1956,"completion_tokens":1}`, "1956", "", ""},
		{`{"prompt_tokens":1956,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":1792,"external_cached_tokens":1776}}`, "1956", "1776", "164"},
	} {
		dec := json.NewDecoder(bytes.NewReader([]byte(tc.usage)))
		dec.UseNumber() // as the prefill leg decodes P's answer
		var usage map[string]any
		if err := dec.Decode(&usage); err != nil {
			t.Fatal(err)
		}
		h := http.Header{}
		setUsageHeaders(h, usage)
		if got := [3]string{h.Get(HeaderPromptTokens), h.Get(HeaderPulledTokens), h.Get(HeaderComputedTokens)}; got != [3]string{tc.prompt, tc.pulled, tc.computed} {
			t.Errorf("usage %s: headers prompt/pulled/computed %q, want %q", tc.usage, got, [3]string{tc.prompt, tc.pulled, tc.computed})
		}
	}
}
