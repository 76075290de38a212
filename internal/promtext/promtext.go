// Package promtext reads a Prometheus text exposition (what GET /metrics serves) into samples,
// with the Prometheus project's own parser (expfmt). `kvbridge check` reads engines with it, and
// tests through internal/fixture.Scrape.
package promtext

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Samples are a page's samples by name: a histogram's under name_bucket (with its le label),
// name_sum and name_count, a summary's under name (with quantile), name_sum and name_count.
type Samples map[string][]Sample

// Sample is one sample: its labels as exposed (`{a="1",b="2"}`, sorted by name, or "") and its
// value.
type Sample struct {
	Labels string
	Value  float64
}

// Parse reads a text exposition.
func Parse(r io.Reader) (Samples, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	families, err := p.TextToMetricFamilies(r)
	if err != nil {
		return nil, fmt.Errorf("promtext: %w", err)
	}
	out := Samples{}
	for name, f := range families {
		for _, m := range f.GetMetric() {
			labels := m.GetLabel()
			add := func(suffix string, v float64, extra ...*dto.LabelPair) {
				out[name+suffix] = append(out[name+suffix], Sample{Labels: format(labels, extra...), Value: v})
			}
			switch {
			case m.Histogram != nil:
				h := m.GetHistogram()
				buckets := h.GetBucket()
				for _, b := range buckets {
					add("_bucket", float64(b.GetCumulativeCount()), pair("le", b.GetUpperBound()))
				}
				if n := len(buckets); n == 0 || !math.IsInf(buckets[n-1].GetUpperBound(), 1) {
					add("_bucket", float64(h.GetSampleCount()), pair("le", math.Inf(1)))
				}
				add("_sum", h.GetSampleSum())
				add("_count", float64(h.GetSampleCount()))
			case m.Summary != nil:
				s := m.GetSummary()
				for _, q := range s.GetQuantile() {
					add("", q.GetValue(), pair("quantile", q.GetQuantile()))
				}
				add("_sum", s.GetSampleSum())
				add("_count", float64(s.GetSampleCount()))
			case m.Counter != nil:
				add("", m.GetCounter().GetValue())
			case m.Gauge != nil:
				add("", m.GetGauge().GetValue())
			default:
				add("", m.GetUntyped().GetValue())
			}
		}
	}
	return out, nil
}

// Sum returns the sum of name's samples whose labels contain every one of labels
// (`key="value"`): 0 when there is none.
func (s Samples) Sum(name string, labels ...string) float64 {
	var sum float64
	for _, x := range s.matching(name, labels) {
		sum += x.Value
	}
	return sum
}

// Has reports whether name has a sample whose labels contain every one of labels.
func (s Samples) Has(name string, labels ...string) bool { return len(s.matching(name, labels)) > 0 }

func (s Samples) matching(name string, labels []string) []Sample {
	var out []Sample
	for _, x := range s[name] {
		match := true
		for _, l := range labels {
			match = match && strings.Contains(x.Labels, l)
		}
		if match {
			out = append(out, x)
		}
	}
	return out
}

func pair(name string, v float64) *dto.LabelPair {
	value := strconv.FormatFloat(v, 'g', -1, 64)
	if math.IsInf(v, 1) {
		value = "+Inf"
	}
	return &dto.LabelPair{Name: &name, Value: &value}
}

var escaper = strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`)

// format writes label pairs as the text format does, sorted by name.
func format(labels []*dto.LabelPair, extra ...*dto.LabelPair) string {
	all := append(slices.Clone(labels), extra...)
	if len(all) == 0 {
		return ""
	}
	slices.SortFunc(all, func(a, b *dto.LabelPair) int { return strings.Compare(a.GetName(), b.GetName()) })
	var b strings.Builder
	b.WriteByte('{')
	for i, l := range all {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(l.GetName() + `="` + escaper.Replace(l.GetValue()) + `"`)
	}
	b.WriteByte('}')
	return b.String()
}
