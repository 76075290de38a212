package proxy

import (
	"encoding/json"
	"net/http"
)

// Error codes the proxy itself answers with, in OpenAI's error JSON.
const (
	codePrefillFailed = "prefill_request_failed"
	codeDecodeFailed  = "decode_request_failed"
	codeBadRequest    = "invalid_request"
)

// writeError answers with OpenAI's error shape: {"error":{"message","type","param","code"}}.
func writeError(w http.ResponseWriter, status int, typ, code, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{
		"message": msg, "type": typ, "param": nil, "code": code,
	}})
}
