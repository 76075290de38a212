package check

import (
	"strconv"
	"strings"
	"testing"

	"github.com/kvbridge/kvbridge/internal/promtext"
)

// TestTokensPreferBySource: when D exports vllm:prompt_tokens_by_source_total, the tokens pulled
// and computed are D's own counts by source, not its usage (which may lack the details, or
// count only the requests check sent through the proxy).
func TestTokensPreferBySource(t *testing.T) {
	page := func(external, local, bytes int) promtext.Samples {
		m, err := promtext.Parse(strings.NewReader(strings.Join([]string{
			"# HELP vllm:prompt_tokens_by_source_total Prompt tokens by source.",
			"# TYPE vllm:prompt_tokens_by_source_total counter",
			`vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} ` + strconv.Itoa(external),
			`vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} ` + strconv.Itoa(local),
			`vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 0`,
			`vllm:nixl_bytes_transferred_sum{engine="0",model_name="m"} ` + strconv.Itoa(bytes),
			`vllm:nixl_bytes_transferred_count{engine="0",model_name="m"} 1`,
		}, "\n") + "\n"))
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	d := &engine{leg: "decode", url: "http://d", before: page(100, 10, 1000), after: page(400, 13, 5000)}
	r := &Report{}
	r.transfers([]*engine{d}, []answer{{status: 200, prompt: 303, details: true, external: 0}}, nil, nil)
	if !r.OK() {
		t.Errorf("problems %+v, want none: D's counts say 300 tokens were pulled", r.Problems)
	}
	want := "prompt tokens: 303 sent, 300 pulled from P, 3 computed on D (vllm:prompt_tokens_by_source_total)"
	if !strings.Contains(strings.Join(r.Lines, "\n"), want) {
		t.Errorf("lines %q, want %q", r.Lines, want)
	}

	r = &Report{}
	none := &engine{leg: "decode", url: "http://d", before: page(400, 13, 5000), after: page(400, 316, 5000)}
	r.transfers([]*engine{none}, []answer{{status: 200, prompt: 303}}, nil, nil)
	if !r.Has(ProblemNotPulled) {
		t.Errorf("problems %+v, want %q: D computed all 303 tokens", r.Problems, ProblemNotPulled)
	}
}

// TestCompatDiffNamesTheFactors: with three engines, one of which does not report what its hash
// covers, the factors that differ are named with each value and its engines; those that agree
// are not; without any engine reporting them, the hashes themselves are listed.
func TestCompatDiffNamesTheFactors(t *testing.T) {
	conn := "NixlConnector"
	eng := func(url, hash string, compat map[string]any) *engine {
		return &engine{leg: "decode", url: url, info: &kvInfo{Connector: &conn, Role: "kv_consumer", CompatibilityHash: hash, Compatibility: compat}}
	}
	p := eng("http://p", "h1", map[string]any{"model": "m", "cache_dtype": "fp8", "num_kv_heads": 8.0})
	p.leg, p.info.Role = "prefill", "kv_producer"
	d1 := eng("http://d1", "h2", map[string]any{"model": "m", "cache_dtype": "bfloat16", "num_kv_heads": 8.0, "quantization": "int8"})
	old := eng("http://old", "h3", nil)
	d2 := eng("http://d2", "h2", map[string]any{"model": "m", "cache_dtype": "bfloat16", "num_kv_heads": 8.0, "quantization": "int8"})
	var r Report
	r.configuration([]*engine{p, d1, old, d2})
	want := `(cache_dtype "fp8" (http://p) vs "bfloat16" (http://d1, http://d2); quantization (none) (http://p) vs "int8" (http://d1, http://d2))`
	if !r.Has(ProblemCompat) || !strings.Contains(r.Problems[0].Detail, want) {
		t.Errorf("problems %+v, want one saying %s", r.Problems, want)
	}

	var hashesOnly Report
	hashesOnly.configuration([]*engine{eng("http://a", "h1", nil), eng("http://b", "h2", nil)})
	if want := "(h1 on http://a; h2 on http://b)"; !hashesOnly.Has(ProblemCompat) || !strings.Contains(hashesOnly.Problems[0].Detail, want) {
		t.Errorf("problems %+v, want one saying %s", hashesOnly.Problems, want)
	}
}
