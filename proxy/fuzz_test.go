package proxy

import (
	"bytes"
	"testing"
)

// FuzzSSEParse feeds arbitrary bytes to the SSE event reader and the multi-turn proxy's event
// parser (what D's stream says): never a panic, and no event keeps D's kv_transfer_params.
func FuzzSSEParse(f *testing.F) {
	f.Add([]byte("data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n"))
	f.Add([]byte("data: {\"choices\":[],\"kv_transfer_params\":{\"remote_block_ids\":[[1]]}}\r\n\r\n"))
	f.Add([]byte("data: {\"error\":{\"message\":\"Internal server error\",\"code\":500}}\n\ndata: [DONE]\n"))
	f.Add([]byte("data: {\"choices\":[{\"delta\":{\"reasoning_content\":\"x\",\"tool_calls\":[]}}],\"usage\":{\"prompt_tokens\":3}}"))
	f.Fuzz(func(t *testing.T, stream []byte) {
		events := newEventReader(bytes.NewReader(stream))
		var a answer
		for range len(stream) + 1 {
			data, err := events.next()
			if err != nil {
				break
			}
			out, _, _ := a.event(data)
			if _, params := withoutParams(out); params != nil {
				t.Fatalf("params survived in %q", out)
			}
			untracked, _, _ := (*answer)(nil).event(data) // the one-way proxy tracks nothing
			if _, params := withoutParams(untracked); params != nil {
				t.Fatalf("params survived in %q", untracked)
			}
		}
	})
}
