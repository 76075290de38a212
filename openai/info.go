package openai

import "net/http"

// modelCard is one entry of GET /v1/models.
type modelCard struct {
	ID          string  `json:"id"`
	Object      string  `json:"object"`
	Created     int64   `json:"created"`
	OwnedBy     string  `json:"owned_by"`
	Root        string  `json:"root"`
	Parent      *string `json:"parent"`
	MaxModelLen int     `json:"max_model_len"`
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
			OwnedBy: "kvbridge", Root: s.model.Name(), MaxModelLen: s.cfg.MaxModelLen})
	}
	writeJSON(w, http.StatusOK, list)
}

// handleHealth serves GET /health: 200 with an empty body, as vLLM does.
func (s *Server) handleHealth(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusOK) }

// handleVersion serves GET /version: {"version": "..."}.
func (s *Server) handleVersion(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, map[string]string{"version": s.cfg.Version})
}
