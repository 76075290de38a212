package multiturn

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
)

// MetricNames returns the rows of the summary table, in order.
func MetricNames() []string {
	return []string{"ttft_ms", "tpot_ms", "latency_ms", "input_num_turns", "input_num_tokens", "output_num_tokens", "output_num_chunks"}
}

// metricValue returns metric name of s.
func metricValue(s RequestStats, name string) float64 {
	switch name {
	case "ttft_ms":
		return s.TTFTMs
	case "tpot_ms":
		return s.TPOTMs
	case "latency_ms":
		return s.LatencyMs
	case "input_num_turns":
		return float64(s.InputNumTurns)
	case "input_num_tokens":
		return float64(s.InputNumTokens)
	case "output_num_tokens":
		return float64(s.OutputNumTokens)
	case "output_num_chunks":
		return float64(s.OutputNumChunks)
	}
	return math.NaN()
}

// Param is one key=value line of a report block.
type Param struct {
	Key   string
	Value any
}

// Params is an ordered parameter block; it marshals to a JSON object in its order.
type Params []Param

// MarshalJSON writes the block as an ordered object.
func (ps Params) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, p := range ps {
		if i > 0 {
			b.WriteByte(',')
		}
		k, _ := json.Marshal(p.Key)
		v, err := json.Marshal(p.Value)
		if err != nil {
			return nil, fmt.Errorf("parameter %s: %w", p.Key, err)
		}
		b.Write(k)
		b.WriteByte(':')
		b.Write(v)
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

// UnmarshalJSON reads an object (keys in sorted order: JSON objects carry no order).
func (ps *Params) UnmarshalJSON(data []byte) error {
	var m map[string]any
	if err := json.Unmarshal(data, &m); err != nil {
		return err
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	*ps = (*ps)[:0]
	for _, k := range keys {
		*ps = append(*ps, Param{Key: k, Value: m[k]})
	}
	return nil
}

// Window is the summary of the samples left after dropping a warm-up share.
type Window struct {
	// WarmupPercent is the share of the earliest samples dropped, in percent.
	WarmupPercent float64 `json:"warmup_percent"`
	NumSamples    int     `json:"num_samples"`
	// RuntimeSec runs from the start of the first kept request to the end of the last one to
	// finish; RequestsPerSec is NumSamples ÷ RuntimeSec.
	RuntimeSec     float64         `json:"runtime_sec"`
	RequestsPerSec float64         `json:"requests_per_sec"`
	Metrics        map[string]Stat `json:"metrics"`
}

// Summary is the benchmark's report; it is what --json writes and `bench compare` reads.
type Summary struct {
	Benchmark            string   `json:"benchmark"`
	URL                  string   `json:"url"`
	Parameters           Params   `json:"parameters"`
	GenerationParameters Params   `json:"generation_parameters,omitempty"`
	TokenCounter         string   `json:"token_counter"`
	TokensEstimated      bool     `json:"tokens_estimated"`
	Notices              []string `json:"notices,omitempty"`

	NumRequests              int `json:"num_requests"`
	NumFailedRequests        int `json:"num_failed_requests"`
	NumConversations         int `json:"num_conversations"`
	NumConversationsFinished int `json:"num_conversations_finished"`

	// RuntimeSec, RequestsPerSec and Metrics are those of the first window (the smallest
	// warm-up share, 0 % by default).
	RuntimeSec                float64         `json:"runtime_sec"`
	RequestsPerSec            float64         `json:"requests_per_sec"`
	WarmupRuntimeSec          *float64        `json:"warmup_runtime_sec,omitempty"`
	TotalRuntimeInclWarmupSec *float64        `json:"total_runtime_incl_warmup_sec,omitempty"`
	Metrics                   map[string]Stat `json:"metrics"`
	Windows                   []Window        `json:"windows"`

	// TTFTMsByTurn[i] is the mean ttft_ms of user turn i+1 over the first window (null when no
	// request of that turn was measured); RequestsByTurn[i] counts those requests.
	TTFTMsByTurn   []*float64 `json:"ttft_ms_by_turn"`
	RequestsByTurn []int      `json:"requests_by_turn"`
}

// ReportInfo is what Summarize needs besides the result.
type ReportInfo struct {
	// Model is the --model argument (the tokenizer); Options are the options given to Run.
	Model   string
	Options Options
	// Input is the loaded input file (generation parameters, notices); may be nil.
	Input *Input
	// WarmupPercentages are the shares of samples to drop, each in [0, 1); empty means {0}.
	WarmupPercentages []float64
}

// Summarize builds the report of res.
func Summarize(res *Result, info ReportInfo) *Summary {
	o := info.Options
	s := &Summary{
		Benchmark:                "kvbridge bench multi-turn",
		URL:                      o.URL,
		NumRequests:              len(res.Samples),
		NumFailedRequests:        res.Failures,
		NumConversations:         res.NumConversations,
		NumConversationsFinished: len(res.Conversations),
		Metrics:                  map[string]Stat{},
		Windows:                  []Window{},
		TTFTMsByTurn:             []*float64{},
		RequestsByTurn:           []int{},
	}
	clients := max(o.NumClients, 1)
	s.Parameters = Params{
		{"model", info.Model},
		{"num_clients", clients},
		{"num_conversations", res.NumConversations},
		{"active_conversations", res.ActiveConversations},
		{"seed", o.Seed},
	}
	if o.LimitMinTokens > 0 {
		s.Parameters = append(s.Parameters, Param{"min_tokens", o.LimitMinTokens})
	}
	if o.LimitMaxTokens > 0 {
		s.Parameters = append(s.Parameters, Param{"max_tokens", o.LimitMaxTokens})
	}
	if o.Tokens != nil {
		s.TokenCounter, s.TokensEstimated = o.Tokens.String(), o.Tokens.Estimated()
	}
	if info.Input != nil {
		s.Notices = info.Input.Notices
		if g := info.Input.Gen; g != nil {
			for _, kv := range g.Params() {
				s.GenerationParameters = append(s.GenerationParameters, Param{kv[0], kv[1]})
			}
		}
	}
	if res.WarmupRuntime > 0 {
		w := res.WarmupRuntime.Seconds()
		s.WarmupRuntimeSec = &w
	}

	samples := slices.Clone(res.Samples)
	slices.SortStableFunc(samples, func(a, b RequestStats) int { return cmpFloat(a.StartTimeMs, b.StartTimeMs) })
	warmups := slices.Clone(info.WarmupPercentages)
	if len(warmups) == 0 {
		warmups = []float64{0}
	}
	slices.Sort(warmups)
	for _, p := range warmups {
		drop := int(p * float64(len(samples)))
		kept := samples[drop:]
		if len(kept) == 0 {
			break
		}
		w := Window{WarmupPercent: 100 * p, NumSamples: len(kept), Metrics: map[string]Stat{}}
		end := 0.0
		for _, r := range kept {
			end = max(end, r.StartTimeMs+r.LatencyMs)
		}
		w.RuntimeSec = (end - kept[0].StartTimeMs) / 1000
		if w.RuntimeSec > 0 {
			w.RequestsPerSec = float64(len(kept)) / w.RuntimeSec
		}
		qs := PercentilesFor(len(kept))
		for _, name := range MetricNames() {
			vals := make([]float64, len(kept))
			for i, r := range kept {
				vals[i] = metricValue(r, name)
			}
			w.Metrics[name] = Describe(vals, qs)
		}
		s.Windows = append(s.Windows, w)
	}
	if len(s.Windows) > 0 {
		first := s.Windows[0]
		s.RuntimeSec, s.RequestsPerSec, s.Metrics = first.RuntimeSec, first.RequestsPerSec, first.Metrics
		kept := samples[int(warmups[0]*float64(len(samples))):]
		sums := []float64{}
		for _, r := range kept {
			t := r.Turn()
			for len(sums) < t {
				sums = append(sums, 0)
				s.RequestsByTurn = append(s.RequestsByTurn, 0)
			}
			sums[t-1] += r.TTFTMs
			s.RequestsByTurn[t-1]++
		}
		for i, sum := range sums {
			if n := s.RequestsByTurn[i]; n > 0 {
				m := sum / float64(n)
				s.TTFTMsByTurn = append(s.TTFTMsByTurn, &m)
			} else {
				s.TTFTMsByTurn = append(s.TTFTMsByTurn, nil)
			}
		}
	}
	if s.WarmupRuntimeSec != nil {
		t := s.RuntimeSec + *s.WarmupRuntimeSec
		s.TotalRuntimeInclWarmupSec = &t
	}
	return s
}

// ParseWarmupPercentages parses --warmup-percentages ("0%,50%"): each value in [0, 100), the
// "%" optional; it returns fractions sorted ascending.
func ParseWarmupPercentages(s string) ([]float64, error) {
	var out []float64
	for _, part := range strings.Split(s, ",") {
		p := strings.TrimSuffix(strings.TrimSpace(part), "%")
		v, err := strconv.ParseFloat(p, 64)
		if err != nil || v < 0 || v >= 100 || math.IsNaN(v) {
			return nil, fmt.Errorf("%w: warmup percentage %q must be in [0%%, 100%%)", ErrOptions, part)
		}
		out = append(out, v/100)
	}
	slices.Sort(out)
	return out, nil
}

// WriteSummaryJSON writes s to path (the --json file).
func WriteSummaryJSON(path string, s *Summary) error {
	b, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return fmt.Errorf("encoding summary: %w", err)
	}
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("writing summary: %w", err)
	}
	return nil
}

// ReadSummaryJSON reads a summary written by WriteSummaryJSON.
func ReadSummaryJSON(path string) (*Summary, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("reading summary: %w", err)
	}
	var s Summary
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("%s: not a `kvbridge bench multi-turn --json` summary: %w", path, err)
	}
	if s.Metrics == nil && s.TTFTMsByTurn == nil {
		return nil, fmt.Errorf("%s: not a `kvbridge bench multi-turn --json` summary (no metrics, no ttft_ms_by_turn)", path)
	}
	return &s, nil
}

// WriteStatsJSON writes the per-request records as a JSON array (--stats-json-output).
func WriteStatsJSON(path string, samples []RequestStats) error {
	if samples == nil {
		samples = []RequestStats{}
	}
	b, err := json.MarshalIndent(samples, "", "  ")
	if err != nil {
		return fmt.Errorf("encoding request stats: %w", err)
	}
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("writing request stats: %w", err)
	}
	return nil
}
