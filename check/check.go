// Package check tells whether a P/D deployment really disaggregates: `kvbridge check` sends a
// few requests through a proxy, reads the engines' /metrics and GET /v1/kv_transfer before and
// after, and names what is wrong — "P and D swapped", "auth token differs", "no connector
// configured", "KV not pulled" — when the answers came back 200 but the KV was recomputed. It
// talks HTTP only (it reads /metrics with internal/promtext); docs/architecture.md shows where it sits.
package check

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/kvbridge/kvbridge/internal/promtext"
)

// Config says what to check.
type Config struct {
	// Proxy is the base URL of the P/D proxy (one-way or multi-turn). Required.
	Proxy string
	// Prefill and Decode are the base URLs of the engines behind it, optional: with them check
	// also reads each engine's connector, metrics and a reference answer.
	Prefill, Decode []string
	// APIKey is sent as "Authorization: Bearer <key>" when set.
	APIKey string
	// Model is the model to ask; "" takes the first of the proxy's /v1/models.
	Model string
	// Requests is how many prompts go through the proxy (default 3).
	Requests int
	// Timeout bounds each HTTP request (default DefaultTimeout).
	Timeout time.Duration
	// Client, when set, is used instead of a client of its own.
	Client *http.Client
}

// DefaultTimeout bounds each HTTP request check sends.
const DefaultTimeout = 2 * time.Minute

// The problems check names.
const (
	ProblemSwapped     = "P and D swapped"
	ProblemAuth        = "auth token differs"
	ProblemNoConnector = "no connector configured"
	ProblemNotPulled   = "KV not pulled"
	ProblemCompat      = "compatibility hash differs"
	ProblemOutputs     = "outputs differ from recompute"
	ProblemRequests    = "requests fail"
	ProblemNotReused   = "conversation KV not reused"
	ProblemUnreachable = "unreachable"
)

// validate checks cfg's URLs.
func (cfg *Config) validate() error {
	if cfg.Proxy == "" {
		return errors.New("--proxy is required")
	}
	for _, u := range append([]string{cfg.Proxy}, append(cfg.Prefill, cfg.Decode...)...) {
		p, err := url.Parse(u)
		if err != nil || (p.Scheme != "http" && p.Scheme != "https") || p.Host == "" {
			return fmt.Errorf("%q is not an http:// or https:// URL", u)
		}
	}
	return nil
}

// engine is one engine given on the command line, and what it said.
type engine struct {
	leg     string // "prefill" or "decode"
	url     string
	info    *kvInfo // nil when the engine does not report it
	err     error
	before  promtext.Samples
	after   promtext.Samples
	infoEnd *kvInfo
}

// kvInfo is GET /v1/kv_transfer (connector.Info, read over HTTP).
type kvInfo struct {
	Connector         *string `json:"kv_connector"`
	Role              string  `json:"kv_role"`
	EngineID          string  `json:"engine_id"`
	Bidirectional     bool    `json:"bidirectional_kv_xfer"`
	AuthToken         bool    `json:"auth_token"`
	CompatibilityHash string  `json:"compatibility_hash"`
	// Compatibility is what the hash covers, by factor (absent from engines before kvbridge
	// reported it).
	Compatibility      map[string]any `json:"compatibility"`
	Backends           []string       `json:"backends"`
	MappedBytes        int64          `json:"mapped_bytes"`
	ServedTCPReadBytes int64          `json:"served_tcp_read_bytes"`
	BytesRead          int64          `json:"bytes_read"`
	// BytesWritten and ServedTCPWriteBytes are push mode's: P's writes, and those D took over TCP.
	BytesWritten        int64 `json:"bytes_written"`
	ServedTCPWriteBytes int64 `json:"served_tcp_write_bytes"`
	Refusals            struct {
		SideChannel int64 `json:"side_channel"`
		Transfer    int64 `json:"transfer"`
		Params      int64 `json:"params"`
	} `json:"refusals"`
	ParamsAuthMismatch int64 `json:"params_auth_mismatch"`
	// IgnoredParams counts the params an engine without a connector ignored.
	IgnoredParams int64 `json:"ignored_kv_transfer_params"`
}

// answer is one completion's outcome.
type answer struct {
	status                   int
	header                   http.Header
	text, errMsg             string
	prompt, cached, external int
	details                  bool // usage had prompt_tokens_details
}

// Run checks the deployment cfg describes. The error is for a config that cannot be used; a
// deployment that does not work is a Report with problems.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if cfg.Requests <= 0 {
		cfg.Requests = 3
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultTimeout
	}
	hc := cfg.Client
	if hc == nil {
		hc = &http.Client{Timeout: cfg.Timeout}
	}
	c := client{hc: hc, apiKey: cfg.APIKey}
	proxy := strings.TrimRight(cfg.Proxy, "/")
	r := &Report{Proxy: proxy}

	healthBefore, err := proxyHealth(ctx, c, proxy)
	if err != nil {
		r.problem(ProblemUnreachable, "the proxy did not answer GET /healthcheck: %v", err)
		return r, nil
	}
	_, r.MultiTurn = healthBefore["store"]
	var engines []*engine
	for _, u := range cfg.Prefill {
		engines = append(engines, &engine{leg: "prefill", url: strings.TrimRight(u, "/")})
	}
	for _, u := range cfg.Decode {
		engines = append(engines, &engine{leg: "decode", url: strings.TrimRight(u, "/")})
	}
	for _, e := range engines {
		e.info, e.before, e.err = readEngine(ctx, c, e.url)
	}
	r.configuration(engines)

	model := cfg.Model
	if model == "" {
		if model, err = firstModel(ctx, c, proxy); err != nil {
			r.problem(ProblemUnreachable, "the proxy's GET /v1/models: %v", err)
			return r, nil
		}
	}
	nonce := make([]byte, 6)
	_, _ = rand.Read(nonce) // a fresh prompt, so that no prefix cache answers for the transfer
	prompts := make([]string, cfg.Requests)
	answers := make([]answer, cfg.Requests)
	for i := range prompts {
		prompts[i] = longPrompt(hex.EncodeToString(nonce), i)
		answers[i] = complete(ctx, c, proxy, model, prompts[i])
	}
	r.requests(answers)
	if r.MultiTurn {
		r.conversation(ctx, c, proxy, model, hex.EncodeToString(nonce))
	}
	if len(cfg.Prefill) > 0 && answers[0].status == http.StatusOK {
		ref := complete(ctx, c, strings.TrimRight(cfg.Prefill[0], "/"), model, prompts[0])
		r.compare(answers[0], ref, cfg.Prefill[0])
	}

	for _, e := range engines {
		if e.err == nil {
			e.infoEnd, e.after, e.err = readEngine(ctx, c, e.url)
		}
	}
	healthAfter, _ := proxyHealth(ctx, c, proxy)
	r.transfers(engines, answers, healthBefore, healthAfter)
	return r, nil
}

// proxyHealth reads the proxy's /healthcheck.
func proxyHealth(ctx context.Context, c client, proxy string) (map[string]any, error) {
	var h map[string]any
	err := c.getJSON(ctx, proxy+"/healthcheck", &h)
	return h, err
}

// withoutTransfer reads a count of the proxy's requests_without_kv_transfer.
func withoutTransfer(h map[string]any, reason string) float64 {
	m, _ := h["requests_without_kv_transfer"].(map[string]any)
	n, _ := m[reason].(float64)
	return n
}

// readEngine reads an engine's connector (nil if it does not say) and metrics.
func readEngine(ctx context.Context, c client, base string) (*kvInfo, promtext.Samples, error) {
	status, body, err := c.get(ctx, base+"/v1/kv_transfer")
	if err != nil {
		return nil, nil, err
	}
	var info *kvInfo
	if status == http.StatusOK {
		info = &kvInfo{}
		if err := json.Unmarshal(body, info); err != nil {
			return nil, nil, fmt.Errorf("GET /v1/kv_transfer: %w", err)
		}
	}
	status, page, err := c.get(ctx, base+"/metrics")
	if err != nil {
		return info, nil, err
	}
	if status != http.StatusOK {
		return info, nil, fmt.Errorf("GET /metrics: %d", status)
	}
	m, err := promtext.Parse(bytes.NewReader(page))
	if err != nil {
		return info, nil, fmt.Errorf("GET /metrics: %w", err)
	}
	return info, m, nil
}

func firstModel(ctx context.Context, c client, base string) (string, error) {
	var models struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := c.getJSON(ctx, base+"/v1/models", &models); err != nil {
		return "", err
	}
	if len(models.Data) == 0 {
		return "", errors.New("no model listed")
	}
	return models.Data[0].ID, nil
}

// longPrompt is a prompt of a few hundred tokens, several KV blocks, unique to this run.
func longPrompt(nonce string, i int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Prompt %d of check %s. ", i, nonce) // distinct from the first block on
	for j := range 24 {
		fmt.Fprintf(&b, "Sentence %d tells the engine something it must remember about item %d. ", j, i*31+j)
	}
	return b.String()
}

// complete asks base for a completion of prompt at temperature 0.
func complete(ctx context.Context, c client, base, model, prompt string) answer {
	return ask(ctx, c, base+"/v1/completions", map[string]any{"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0})
}

// ask posts body and reads the JSON answer.
func ask(ctx context.Context, c client, url string, body map[string]any) answer {
	status, hdr, data, err := c.post(ctx, url, body)
	a := answer{status: status, header: hdr}
	if err != nil {
		a.errMsg = err.Error()
		return a
	}
	var out struct {
		Choices []struct {
			Text    string `json:"text"`
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
		Usage *struct {
			PromptTokens int `json:"prompt_tokens"`
			Details      *struct {
				Cached   int `json:"cached_tokens"`
				External int `json:"external_cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
		Error *struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	if err := json.Unmarshal(data, &out); err != nil {
		a.errMsg = fmt.Sprintf("the answer is not JSON: %s", clip(data))
		return a
	}
	if out.Error != nil {
		a.errMsg = out.Error.Message
	}
	if status != http.StatusOK && a.errMsg == "" {
		a.errMsg = clip(data)
	}
	for _, ch := range out.Choices {
		a.text += ch.Text + ch.Message.Content
	}
	if u := out.Usage; u != nil {
		a.prompt = u.PromptTokens
		if u.Details != nil {
			a.details, a.cached, a.external = true, u.Details.Cached, u.Details.External
		}
	}
	return a
}
