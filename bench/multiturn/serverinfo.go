package multiturn

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"
)

// ServerInfo asks the server for its version (GET /version, optional) and models
// (GET /v1/models) and returns lines describing them, as the original prints before a run.
// Failures become lines too; it never fails the benchmark.
func ServerInfo(ctx context.Context, hc *http.Client, url string, header http.Header) []string {
	if hc == nil {
		hc = http.DefaultClient
	}
	url = strings.TrimRight(url, "/")
	get := func(path string) (int, []byte, error) {
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url+path, nil)
		if err != nil {
			return 0, nil, err
		}
		for k, vs := range header {
			req.Header[k] = vs
		}
		resp, err := hc.Do(req)
		if err != nil {
			return 0, nil, err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		return resp.StatusCode, b, err
	}
	var lines []string
	if code, b, err := get("/version"); err == nil && code == http.StatusOK {
		lines = append(lines, "server version: "+strings.TrimSpace(string(b)))
	}
	code, b, err := get("/v1/models")
	switch {
	case err != nil:
		lines = append(lines, fmt.Sprintf("failed to get models from %s: %v", url, err))
	case code != http.StatusOK:
		lines = append(lines, fmt.Sprintf("failed to get models from %s: HTTP %d", url, code))
	default:
		var models struct {
			Data []struct {
				ID          string `json:"id"`
				MaxModelLen *int   `json:"max_model_len"`
			} `json:"data"`
		}
		if err := json.Unmarshal(b, &models); err != nil {
			lines = append(lines, fmt.Sprintf("failed to parse the models of %s: %v", url, err))
			break
		}
		for _, m := range models.Data {
			ml := "N/A"
			if m.MaxModelLen != nil {
				ml = fmt.Sprint(*m.MaxModelLen)
			}
			lines = append(lines, fmt.Sprintf("model: id=%s, max_model_len=%s", m.ID, ml))
		}
	}
	return lines
}
