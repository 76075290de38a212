package grafana_test

import (
	"testing"

	"github.com/kvbridge/kvbridge/internal/fixture"
)

// TestPulledVsRecomputed: the "Pulled vs recomputed" panel tells a P/D request as it happened.
// After one request through the proxy, P's vllm:prompt_tokens_by_source_total counts the whole
// prompt as computed there; D's counts it as pulled over KV transfer (what D's connector
// loaded), with only the last prompt token computed again for its logits, as in vLLM. Each
// engine observed the request's phases once.
func TestPulledVsRecomputed(t *testing.T) {
	s, hc := startPD(t)
	bySource := "vllm:prompt_tokens_by_source_total"
	type reading struct{ compute, hit, pulled, queued, prefilled, n float64 }
	read := func(url string) reading {
		m := fixture.Scrape(t, hc, url)
		return reading{
			compute:   m.Sum(bySource, `source="local_compute"`),
			hit:       m.Sum(bySource, `source="local_cache_hit"`),
			pulled:    m.Sum(bySource, `source="external_kv_transfer"`),
			queued:    m.Sum("vllm:request_queue_time_seconds_count"),
			prefilled: m.Sum("vllm:request_prefill_time_seconds_count"),
			n:         m.Sum("vllm:request_params_n_count"),
		}
	}
	p0, d0 := read(s.P.URL()), read(s.D.URL())
	ds0, err := s.D.Stats()
	if err != nil {
		t.Fatal(err)
	}
	r := pd(t, s, hc, "Disaggregated serving computes the prompt on one engine and pulls its KV cache into another, which decodes.")
	prompt := float64(r.PromptTokens)
	p1, d1 := read(s.P.URL()), read(s.D.URL())
	ds1, err := s.D.Stats()
	if err != nil {
		t.Fatal(err)
	}
	pulled := float64(ds1.PulledTokens - ds0.PulledTokens)
	if prompt < 16 || pulled != prompt {
		t.Fatalf("the request's %v prompt tokens, D's connector pulled %v", prompt, pulled)
	}
	if got := (reading{compute: p1.compute - p0.compute, hit: p1.hit - p0.hit, pulled: p1.pulled - p0.pulled}); got != (reading{compute: prompt}) {
		t.Errorf("P's prompt sources moved by %+v, want all %v computed", got, prompt)
	}
	if got := (reading{compute: d1.compute - d0.compute, hit: d1.hit - d0.hit, pulled: d1.pulled - d0.pulled}); got != (reading{compute: 1, pulled: pulled}) {
		t.Errorf("D's prompt sources moved by %+v, want %v pulled and the last token computed", got, pulled)
	}
	for role, d := range map[string][2]reading{"P": {p0, p1}, "D": {d0, d1}} {
		if q, pf, n := d[1].queued-d[0].queued, d[1].prefilled-d[0].prefilled, d[1].n-d[0].n; q != 1 || pf != 1 || n != 1 {
			t.Errorf("%s observed %v queue times, %v prefill times and %v n parameters for one request", role, q, pf, n)
		}
	}
}
