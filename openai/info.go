package openai

import (
	"context"
	"fmt"
	"net/http"
	"time"
)

// modelCard is one entry of GET /v1/models.
type modelCard struct {
	ID          string  `json:"id"`
	Object      string  `json:"object"`
	Created     int64   `json:"created"`
	OwnedBy     string  `json:"owned_by"`
	Root        string  `json:"root"`
	Parent      *string `json:"parent"`
	MaxModelLen int     `json:"max_model_len"`
	// Permission is vLLM's one ModelPermission entry.
	Permission []modelPermission `json:"permission"`
}

// modelPermission is vLLM's ModelPermission (OpenAI's legacy shape).
type modelPermission struct {
	ID                 string  `json:"id"`
	Object             string  `json:"object"`
	Created            int64   `json:"created"`
	AllowCreateEngine  bool    `json:"allow_create_engine"`
	AllowSampling      bool    `json:"allow_sampling"`
	AllowLogprobs      bool    `json:"allow_logprobs"`
	AllowSearchIndices bool    `json:"allow_search_indices"`
	AllowView          bool    `json:"allow_view"`
	AllowFineTuning    bool    `json:"allow_fine_tuning"`
	Organization       string  `json:"organization"`
	Group              *string `json:"group"`
	IsBlocking         bool    `json:"is_blocking"`
}

// modelList is the GET /v1/models response.
type modelList struct {
	Object string      `json:"object"`
	Data   []modelCard `json:"data"`
}

// handleModels serves GET /v1/models: the served model names.
func (s *Server) handleModels(w http.ResponseWriter, r *http.Request) {
	list := modelList{Object: "list", Data: make([]modelCard, 0, len(s.cfg.ServedModelNames))}
	for _, name := range s.cfg.ServedModelNames {
		list.Data = append(list.Data, modelCard{ID: name, Object: "model", Created: s.created,
			OwnedBy: "kvbridge", Root: s.model.Name(), MaxModelLen: s.cfg.MaxModelLen,
			Permission: []modelPermission{{ID: "modelperm-" + name, Object: "model_permission", Created: s.created,
				AllowSampling: true, AllowLogprobs: true, AllowView: true, Organization: "*"}}})
	}
	writeJSON(w, http.StatusOK, list)
}

// handleHealth serves GET /health and GET or POST /ping: 200 with an empty body, as vLLM does.
func (s *Server) handleHealth(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusOK) }

// readyTimeout bounds Config.Ready's check.
const readyTimeout = 2 * time.Second

// handleReady serves GET /ready, the readiness probe (vLLM has none; /health stays the liveness
// probe): 200 with {"ready": true} when Config.Ready reports nothing wrong, else 503 in the
// error JSON with its reason.
func (s *Server) handleReady(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Ready != nil {
		ctx, cancel := context.WithTimeout(r.Context(), readyTimeout)
		defer cancel()
		if err := s.cfg.Ready(ctx); err != nil {
			writeError(w, &APIError{Status: http.StatusServiceUnavailable, Type: "ServiceUnavailableError", Message: "not ready: " + err.Error()})
			return
		}
	}
	writeJSON(w, http.StatusOK, map[string]bool{"ready": true})
}

// handleVersion serves GET /version: {"version": "..."}.
func (s *Server) handleVersion(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, map[string]string{"version": s.cfg.Version})
}

// handleKVTransfer serves GET /v1/kv_transfer: what Config.KVInfo says of this engine's
// connector, or {"kv_connector":null} without one.
// handleResetPrefixCache serves POST /reset_prefix_cache: 200 with an empty body, as vLLM, when
// the prefix cache was dropped; 409 when a request still holds blocks (vLLM answers 200 and only
// logs that it could not).
func (s *Server) handleResetPrefixCache(w http.ResponseWriter, r *http.Request) {
	ok, err := s.cfg.ResetPrefixCache(r.Context())
	switch {
	case err != nil:
		writeError(w, &APIError{Status: http.StatusServiceUnavailable, Type: "ServiceUnavailableError",
			Message: fmt.Sprintf("Prefix cache not reset: %v.", err)})
	case !ok:
		writeError(w, &APIError{Status: http.StatusConflict, Type: "ConflictError",
			Message: "Prefix cache not reset: requests still hold KV blocks; retry when they have finished."})
	default:
		w.WriteHeader(http.StatusOK)
	}
}

func (s *Server) handleKVTransfer(w http.ResponseWriter, r *http.Request) {
	if s.cfg.KVInfo == nil {
		writeJSON(w, http.StatusOK, map[string]any{"kv_connector": nil})
		return
	}
	writeJSON(w, http.StatusOK, s.cfg.KVInfo())
}
