package check

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
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

// metrics is a Prometheus text page: each sample line's series (name and labels) and value.
type metrics map[string]float64

// parseMetrics reads the sample lines of a Prometheus text page.
func parseMetrics(page []byte) metrics {
	m := metrics{}
	sc := bufio.NewScanner(bytes.NewReader(page))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		if v, err := strconv.ParseFloat(line[i+1:], 64); err == nil {
			m[line[:i]] += v
		}
	}
	return m
}

// sum adds the values of the series named name whose labels contain every one of labels
// (`source="external_kv_transfer"`), and reports whether there was any.
func (m metrics) sum(name string, labels ...string) (float64, bool) {
	total, found := 0.0, false
	for series, v := range m {
		n, rest, _ := strings.Cut(series, "{")
		if n != name {
			continue
		}
		ok := true
		for _, l := range labels {
			ok = ok && strings.Contains(rest, l)
		}
		if ok {
			total, found = total+v, true
		}
	}
	return total, found
}

// delta is after's sum minus before's.
func delta(before, after metrics, name string, labels ...string) (float64, bool) {
	a, found := after.sum(name, labels...)
	b, _ := before.sum(name, labels...)
	return a - b, found
}

func clip(b []byte) string {
	s := strings.TrimSpace(string(b))
	if len(s) > 300 {
		return s[:300] + "…"
	}
	return s
}
