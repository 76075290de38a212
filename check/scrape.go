package check

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"

	"github.com/kvbridge/kvbridge/internal/promtext"
)

// maxBody bounds what check reads of any answer.
const maxBody = 16 << 20

// client is what check asks deployments with.
type client struct {
	hc     *http.Client
	apiKey string
}

// get fetches url and returns its status and body.
func (c client) get(ctx context.Context, url string) (int, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, nil, err
	}
	return c.do(req)
}

// post sends body as JSON to url and returns the status, the headers and the body.
func (c client) post(ctx context.Context, url string, body any) (int, http.Header, []byte, error) {
	data, err := json.Marshal(body)
	if err != nil {
		return 0, nil, nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(data))
	if err != nil {
		return 0, nil, nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.hc.Do(c.auth(req))
	if err != nil {
		return 0, nil, nil, err
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(io.LimitReader(resp.Body, maxBody))
	return resp.StatusCode, resp.Header, out, err
}

func (c client) auth(req *http.Request) *http.Request {
	if c.apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+c.apiKey)
	}
	return req
}

func (c client) do(req *http.Request) (int, []byte, error) {
	resp, err := c.hc.Do(c.auth(req))
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(io.LimitReader(resp.Body, maxBody))
	return resp.StatusCode, out, err
}

// getJSON fetches url into v; a status other than 200 is an error.
func (c client) getJSON(ctx context.Context, url string, v any) error {
	status, body, err := c.get(ctx, url)
	if err != nil {
		return err
	}
	if status != http.StatusOK {
		return fmt.Errorf("GET %s: %d %s", url, status, clip(body))
	}
	if err := json.Unmarshal(body, v); err != nil {
		return fmt.Errorf("GET %s: %w", url, err)
	}
	return nil
}

// delta is after's sum of the series named name whose labels contain every one of labels
// (`source="external_kv_transfer"`) minus before's, and whether after has any.
func delta(before, after promtext.Samples, name string, labels ...string) (float64, bool) {
	return after.Sum(name, labels...) - before.Sum(name, labels...), after.Has(name, labels...)
}

func clip(b []byte) string {
	s := strings.TrimSpace(string(b))
	if len(s) > 300 {
		return s[:300] + "…"
	}
	return s
}
