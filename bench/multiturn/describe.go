package multiturn

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/kvbridge/kvbridge/stats"
)

// Percentile is one quantile of a Stat.
type Percentile struct {
	Q     float64 // in (0, 1)
	Value float64
}

// Label returns the column name pandas gives the quantile: "25%", "99.9%".
func (p Percentile) Label() string {
	return strconv.FormatFloat(math.Round(p.Q*1e6)/1e4, 'f', -1, 64) + "%"
}

// Stat summarises one metric like pandas' describe(): count, mean, sample standard deviation
// (NaN for fewer than two values), min, percentiles by linear interpolation (numpy's default),
// and max. It marshals to a JSON object with keys in that order ("25%", "50%", …), NaN as null.
type Stat struct {
	Count       int
	Mean, Std   float64
	Min, Max    float64
	Percentiles []Percentile
}

// PercentilesFor returns the quantiles reported for n samples: 25, 50, 75 and 90 %, plus 99 %
// from 100 samples, 99.9 % from 1000 and 99.99 % from 10000.
func PercentilesFor(n int) []float64 {
	qs := []float64{0.25, 0.5, 0.75, 0.9}
	if n >= 100 {
		qs = append(qs, 0.99)
	}
	if n >= 1000 {
		qs = append(qs, 0.999)
	}
	if n >= 10000 {
		qs = append(qs, 0.9999)
	}
	return qs
}

// Describe computes the Stat of vals at quantiles qs. Without values every field is NaN.
func Describe(vals []float64, qs []float64) Stat {
	s := Stat{Count: len(vals)}
	nan := math.NaN()
	if len(vals) == 0 {
		s.Mean, s.Std, s.Min, s.Max = nan, nan, nan, nan
		for _, q := range qs {
			s.Percentiles = append(s.Percentiles, Percentile{Q: q, Value: nan})
		}
		return s
	}
	sorted := slices.Clone(vals)
	slices.Sort(sorted)
	sum := 0.0
	for _, v := range sorted {
		sum += v
	}
	n := float64(len(sorted))
	s.Mean = sum / n
	s.Std = nan
	if len(sorted) > 1 {
		ss := 0.0
		for _, v := range sorted {
			ss += (v - s.Mean) * (v - s.Mean)
		}
		s.Std = math.Sqrt(ss / (n - 1))
	}
	s.Min, s.Max = sorted[0], sorted[len(sorted)-1]
	for _, q := range qs {
		s.Percentiles = append(s.Percentiles, Percentile{Q: q, Value: stats.Quantile(sorted, q)})
	}
	return s
}

// Percentile returns the value of quantile q and whether it was computed.
func (s Stat) Percentile(q float64) (float64, bool) {
	for _, p := range s.Percentiles {
		if math.Abs(p.Q-q) < 1e-9 {
			return p.Value, true
		}
	}
	return math.NaN(), false
}

// columns returns the Stat's column names and values in table order.
func (s Stat) columns() ([]string, []float64) {
	names := []string{"count", "mean", "std", "min"}
	vals := []float64{float64(s.Count), s.Mean, s.Std, s.Min}
	for _, p := range s.Percentiles {
		names = append(names, p.Label())
		vals = append(vals, p.Value)
	}
	return append(names, "max"), append(vals, s.Max)
}

// MarshalJSON writes the Stat as an ordered object; NaN becomes null.
func (s Stat) MarshalJSON() ([]byte, error) {
	names, vals := s.columns()
	var b bytes.Buffer
	b.WriteByte('{')
	for i, n := range names {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, "%q:", n)
		switch {
		case n == "count":
			fmt.Fprintf(&b, "%d", s.Count)
		case math.IsNaN(vals[i]) || math.IsInf(vals[i], 0):
			b.WriteString("null")
		default:
			b.WriteString(strconv.FormatFloat(vals[i], 'g', -1, 64))
		}
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

// UnmarshalJSON reads what MarshalJSON writes (null becomes NaN).
func (s *Stat) UnmarshalJSON(data []byte) error {
	var m map[string]*float64
	if err := json.Unmarshal(data, &m); err != nil {
		return err
	}
	get := func(k string) float64 {
		if v, ok := m[k]; ok && v != nil {
			return *v
		}
		return math.NaN()
	}
	*s = Stat{Mean: get("mean"), Std: get("std"), Min: get("min"), Max: get("max")}
	if c := get("count"); !math.IsNaN(c) {
		s.Count = int(c)
	}
	for k := range m {
		if p, ok := strings.CutSuffix(k, "%"); ok {
			q, err := strconv.ParseFloat(p, 64)
			if err != nil {
				return fmt.Errorf("stat key %q: %w", k, err)
			}
			s.Percentiles = append(s.Percentiles, Percentile{Q: q / 100, Value: get(k)})
		}
	}
	slices.SortFunc(s.Percentiles, func(a, b Percentile) int { return cmpFloat(a.Q, b.Q) })
	return nil
}

// cmpFloat orders two floats.
func cmpFloat(a, b float64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}
