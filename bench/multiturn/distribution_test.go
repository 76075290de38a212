package multiturn

import (
	"encoding/json"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

func newRand(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, 1)) }

func mustDist(t *testing.T, js string) Distribution {
	t.Helper()
	d, err := parseDistribution("x", json.RawMessage(js))
	if err != nil {
		t.Fatalf("%s: %v", js, err)
	}
	return d
}

func TestDistributionsSeededAndBounded(t *testing.T) {
	cases := []struct {
		js       string
		lo, hi   int
		meanLo   float64
		meanHi   float64
		wantType string
	}{
		{`{"distribution":"constant","value":500}`, 500, 500, 500, 500, "Constant[500]"},
		{`{"distribution":"uniform","min":12,"max":18}`, 12, 18, 14.5, 15.5, "Uniform[12, 18]"},
		{`{"distribution":"uniform","min":1.5,"max":3.5}`, 2, 4, 2.3, 2.7, "Uniform[1.5, 3.5]"},
		{`{"distribution":"lognormal","mean":3,"sigma":0.5,"max":40}`, 1, 40, 18, 25, ""},
		{`{"distribution":"lognormal","average":1000,"max":5000}`, 1, 5000, 850, 1001, ""},
		{`{"distribution":"zipf","alpha":1.5,"max":100}`, 1, 100, 1, 20, ""},
		{`{"distribution":"poisson","alpha":3,"max":50}`, 0, 50, 2.8, 3.2, ""},
		{`{"distribution":"poisson","alpha":40}`, 0, 1 << 30, 39, 41, ""},
	}
	for _, c := range cases {
		d := mustDist(t, c.js)
		a := d.Sample(newRand(7), 4000)
		b := d.Sample(newRand(7), 4000)
		if !slices.Equal(a, b) {
			t.Errorf("%s: same seed gave different samples", c.js)
		}
		if c.wantType != "" && d.String() != c.wantType {
			t.Errorf("%s: String() = %q, want %q", c.js, d.String(), c.wantType)
		}
		sum := 0.0
		for _, v := range a {
			if v < c.lo || v > c.hi {
				t.Fatalf("%s: sample %d outside [%d, %d]", c.js, v, c.lo, c.hi)
			}
			sum += float64(v)
		}
		if m := sum / float64(len(a)); m < c.meanLo || m > c.meanHi {
			t.Errorf("%s: mean %.2f outside [%.1f, %.1f]", c.js, m, c.meanLo, c.meanHi)
		}
	}
	// Both ends of an integer uniform are reachable.
	v := mustDist(t, `{"distribution":"uniform","min":1,"max":3}`).Sample(newRand(1), 300)
	if !slices.Contains(v, 1) || !slices.Contains(v, 3) {
		t.Errorf("uniform [1,3] never drew an end: %v", v[:20])
	}
	// Different seeds differ.
	u := mustDist(t, `{"distribution":"uniform","min":1,"max":1000}`)
	if slices.Equal(u.Sample(newRand(1), 50), u.Sample(newRand(2), 50)) {
		t.Error("different seeds gave the same samples")
	}
	// Zipf: 1 is the most frequent value, and the cap piles up mass at max.
	z := mustDist(t, `{"distribution":"zipf","alpha":1.2,"max":10}`).Sample(newRand(3), 5000)
	counts := map[int]int{}
	for _, x := range z {
		counts[x]++
	}
	for k, n := range counts {
		if k != 1 && k != 10 && n > counts[1] {
			t.Errorf("zipf: value %d (%d times) more frequent than 1 (%d)", k, n, counts[1])
		}
	}
	if counts[10] < counts[9] {
		t.Errorf("zipf cap: %d at max vs %d at max-1; capping should pile up mass", counts[10], counts[9])
	}
	// Lognormal average: an uncapped batch averages to the target (up to rounding).
	l := mustDist(t, `{"distribution":"lognormal","average":200}`).Sample(newRand(5), 1000)
	sum := 0
	for _, x := range l {
		sum += x
	}
	if m := float64(sum) / 1000; math.Abs(m-200) > 0.6 {
		t.Errorf("lognormal average batch mean %.3f, want 200", m)
	}
	if one := mustDist(t, `{"distribution":"lognormal","average":500}`).Sample(newRand(5), 1); one[0] != 500 {
		t.Errorf("a single lognormal-average sample is rescaled to the average: got %d", one[0])
	}
}
