package openai

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
)

// APIError is an error in OpenAI's JSON shape, with the HTTP status it is served with.
type APIError struct {
	Status     int    // HTTP status
	Message    string // human-readable message
	Type       string // vLLM's error type, e.g. "BadRequestError"
	Param      string // offending request field, "" when none
	RetryAfter int    // seconds for a Retry-After header; 0 for none
}

// Error implements error.
func (e *APIError) Error() string { return fmt.Sprintf("%d %s: %s", e.Status, e.Type, e.Message) }

// errorBody is the JSON document of an APIError.
type errorBody struct {
	Error errorDetail `json:"error"`
}

type errorDetail struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    int     `json:"code"`
}

func (e *APIError) body() errorBody {
	d := errorDetail{Message: e.Message, Type: e.Type, Code: e.Status}
	if e.Param != "" {
		p := e.Param
		d.Param = &p
	}
	return errorBody{Error: d}
}

// JSON returns the error document, e.g. {"error":{"message":"…","type":"…","param":null,"code":400}}.
func (e *APIError) JSON() []byte {
	b, err := json.Marshal(e.body())
	if err != nil { // cannot happen: the document is strings and an int
		return []byte(`{"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}`)
	}
	return b
}

// badRequest returns a 400 BadRequestError about param.
func badRequest(param, format string, args ...any) *APIError {
	return &APIError{Status: http.StatusBadRequest, Type: "BadRequestError", Param: param, Message: fmt.Sprintf(format, args...)}
}

// unsupported returns a 400 for a parameter kvbridge does not implement.
func unsupported(param, what string) *APIError {
	return badRequest(param, "%s is not supported by kvbridge", what)
}

// modelNotFound returns vLLM's 404 for an unknown model name.
func modelNotFound(name string) *APIError {
	return &APIError{Status: http.StatusNotFound, Type: "NotFoundError", Param: "model",
		Message: fmt.Sprintf("The model `%s` does not exist.", name)}
}

// internalError is vLLM's generic 500 (GenerationError), also used for requests that finish
// with reason "error" such as a KV load failure under policy fail.
func internalError() *APIError {
	return &APIError{Status: http.StatusInternalServerError, Type: "InternalServerError", Message: "Internal server error"}
}

// unavailable returns a 503 for an engine that is shutting down.
func unavailable() *APIError {
	return &APIError{Status: http.StatusServiceUnavailable, Type: "ServiceUnavailableError",
		Message: "The engine is shutting down"}
}

// writeError writes e as the JSON response.
func writeError(w http.ResponseWriter, e *APIError) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Del("Content-Length")
	if e.RetryAfter > 0 {
		w.Header().Set("Retry-After", strconv.Itoa(e.RetryAfter))
	}
	w.WriteHeader(e.Status)
	w.Write(e.JSON())
}
