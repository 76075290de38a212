// Package stats holds the summary statistics kvbridge reports: the mean, the median and
// quantiles of samples, and durations in milliseconds. The benchmarks, the demo, the multi-turn
// benchmark's pandas-style tables and the "KV Transfer metrics" log line all compute them here.
// Functions never modify their input. See docs/architecture.md for where the package sits.
package stats

import (
	"math"
	"slices"
	"time"
)

// Mean returns the arithmetic mean of xs; 0 when empty.
func Mean(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := 0.0
	for _, x := range xs {
		s += x
	}
	return s / float64(len(xs))
}

// Median returns the median of xs (the mean of the middle two for an even count); 0 when empty.
func Median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := sorted(xs)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// NearestRank returns the q-quantile (0 ≤ q ≤ 1) of xs by the nearest-rank method: the
// ⌈q·n⌉-th smallest value (the smallest for q = 0); 0 when empty. A latency's p99 is a value
// that was measured.
func NearestRank(xs []float64, q float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := sorted(xs)
	// The tolerance keeps float error in q·n (0.99·100 = 99.00000000000001) from moving up a rank.
	i := int(math.Ceil(q*float64(len(s))-1e-9)) - 1
	return s[min(max(i, 0), len(s)-1)]
}

// Quantile returns the q-quantile (0 ≤ q ≤ 1) of xs interpolated linearly between the closest
// ranks, exactly as numpy.quantile's default method computes it (including numpy's two-sided
// interpolation, so results match it to the last bit); NaN when empty.
func Quantile(xs []float64, q float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := sorted(xs)
	virtual := float64(len(s)-1) * q
	lo := math.Floor(virtual)
	i := int(lo)
	if i >= len(s)-1 {
		return s[len(s)-1]
	}
	if i < 0 {
		return s[0]
	}
	t := virtual - lo
	x, y := s[i], s[i+1]
	diff := y - x
	if t >= 0.5 {
		return y - diff*(1-t)
	}
	return x + diff*t
}

// Ms returns d in milliseconds.
func Ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// sorted returns a sorted copy of xs.
func sorted(xs []float64) []float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s
}
