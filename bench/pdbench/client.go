package pdbench

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
)

// errStatus reports an engine or proxy answer other than 200.
type errStatus struct {
	url    string
	status int
	body   []byte
}

func (e *errStatus) Error() string {
	b := e.body
	if len(b) > 300 {
		b = b[:300]
	}
	return fmt.Sprintf("pdbench: POST %s answered %d: %s", e.url, e.status, b)
}

// postJSON posts body to url with X-Request-Id reqID (none when empty), reads the whole answer
// and returns it; a status other than 200 is an *errStatus.
func postJSON(ctx context.Context, hc *http.Client, url, reqID string, body []byte) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("pdbench: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	if reqID != "" {
		req.Header.Set("X-Request-Id", reqID)
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("pdbench: %w", err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("pdbench: reading the answer of %s: %w", url, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, &errStatus{url: url, status: resp.StatusCode, body: data}
	}
	return data, nil
}
