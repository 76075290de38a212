package proxy

import (
	"bytes"
	"testing"
)

// FuzzSSEParse feeds arbitrary bytes to the SSE line splitter and the multi-turn proxy's event
// parser (what D's stream says): never a panic, and the splitter loses no bytes.
func FuzzSSEParse(f *testing.F) {
	f.Add([]byte("data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n"))
	f.Add([]byte("data: {\"choices\":[],\"kv_transfer_params\":{\"remote_block_ids\":[[1]]}}\r\n\r\n"))
	f.Add([]byte("data: {\"error\":{\"message\":\"Internal server error\",\"code\":500}}\n\ndata: [DONE]\n"))
	f.Add([]byte("data: {\"choices\":[{\"delta\":{\"reasoning_content\":\"x\",\"tool_calls\":[]}}],\"usage\":{\"prompt_tokens\":3}}"))
	f.Fuzz(func(t *testing.T, stream []byte) {
		var lines [][]byte
		var s lineSplitter
		for i := 0; i < len(stream); i += 7 { // arbitrary read boundaries
			s.feed(stream[i:min(i+7, len(stream))], func(l []byte) { lines = append(lines, append([]byte(nil), l...)) })
		}
		s.flush(func(l []byte) { lines = append(lines, l) })
		var a answer
		for _, l := range lines {
			if data, ok := bytes.CutPrefix(l, []byte("data: ")); ok {
				a.event(data)
				isUsageChunk(data)
			}
		}
		if n := bytes.Count(stream, []byte("\n")); len(lines) < n {
			t.Fatalf("%d lines from %d newlines", len(lines), n)
		}
	})
}
