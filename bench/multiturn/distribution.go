package multiturn

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
)

// Distribution draws the integer values of one generator parameter (turn counts, token counts).
type Distribution interface {
	// Sample returns n values drawn from r.
	Sample(r *rand.Rand, n int) []int
	// String describes the distribution as the report prints it, e.g. "Uniform[12, 18]".
	String() string
}

// Constant always returns Value (rounded to an integer).
type Constant struct{ Value float64 }

// Sample returns n copies of the value.
func (d Constant) Sample(_ *rand.Rand, n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = roundInt(d.Value)
	}
	return out
}

// String implements Distribution.
func (d Constant) String() string { return fmt.Sprintf("Constant[%s]", fmtNum(d.Value)) }

// Uniform draws integers in [Min, Max] inclusive when Integer is set, otherwise floats in
// [Min, Max) rounded to the nearest integer.
type Uniform struct {
	Min, Max float64
	Integer  bool
}

// Sample implements Distribution.
func (d Uniform) Sample(r *rand.Rand, n int) []int {
	out := make([]int, n)
	for i := range out {
		if d.Integer {
			lo, hi := int64(d.Min), int64(d.Max)
			out[i] = int(lo + r.Int64N(hi-lo+1))
		} else {
			out[i] = roundInt(d.Min + r.Float64()*(d.Max-d.Min))
		}
	}
	return out
}

// String implements Distribution.
func (d Uniform) String() string {
	return fmt.Sprintf("Uniform[%s, %s]", fmtNum(d.Min), fmtNum(d.Max))
}

// Lognormal draws exp(N(Mean, Sigma²)), capped at Max when Max > 0, rounded to an integer.
// When Average > 0 the distribution is instead parameterised by its average and the ratio of
// median to average (MedianRatio, default 0.85): Mean and Sigma are derived from them, and each
// batch of samples is rescaled so that its average is exactly Average before capping.
type Lognormal struct {
	Mean, Sigma          float64
	Average, MedianRatio float64
	Max                  float64
}

// params returns the underlying normal's mean and sigma.
func (d Lognormal) params() (mu, sigma float64) {
	if d.Average <= 0 {
		return d.Mean, d.Sigma
	}
	median := d.Average * d.MedianRatio
	return math.Log(median), math.Sqrt(2 * math.Log(d.Average/median))
}

// Sample implements Distribution.
func (d Lognormal) Sample(r *rand.Rand, n int) []int {
	mu, sigma := d.params()
	v := make([]float64, n)
	sum := 0.0
	for i := range v {
		v[i] = math.Exp(mu + sigma*r.NormFloat64())
		sum += v[i]
	}
	out := make([]int, n)
	for i := range v {
		if d.Average > 0 && sum > 0 {
			v[i] *= d.Average / (sum / float64(n))
		}
		if d.Max > 0 {
			v[i] = math.Min(v[i], d.Max)
		}
		out[i] = roundInt(v[i])
	}
	return out
}

// String implements Distribution.
func (d Lognormal) String() string {
	if d.Average > 0 {
		return fmt.Sprintf("Lognormal[average=%s, median_ratio=%s, max=%s]", fmtNum(d.Average), fmtNum(d.MedianRatio), fmtMax(d.Max))
	}
	return fmt.Sprintf("Lognormal[mean=%s, sigma=%s, max=%s]", fmtNum(d.Mean), fmtNum(d.Sigma), fmtMax(d.Max))
}

// Zipf draws k ≥ 1 with probability proportional to k^-Alpha (Alpha > 1), capped at Max when
// Max > 0.
type Zipf struct{ Alpha, Max float64 }

// Sample implements Distribution.
func (d Zipf) Sample(r *rand.Rand, n int) []int {
	z := rand.NewZipf(r, d.Alpha, 1, 1<<53)
	out := make([]int, n)
	for i := range out {
		v := float64(z.Uint64() + 1)
		if d.Max > 0 {
			v = math.Min(v, d.Max)
		}
		out[i] = roundInt(v)
	}
	return out
}

// String implements Distribution.
func (d Zipf) String() string {
	return fmt.Sprintf("Zipf[alpha=%s, max=%s]", fmtNum(d.Alpha), fmtMax(d.Max))
}

// Poisson draws from a Poisson distribution of mean Alpha, capped at Max when Max > 0.
type Poisson struct{ Alpha, Max float64 }

// Sample implements Distribution.
func (d Poisson) Sample(r *rand.Rand, n int) []int {
	out := make([]int, n)
	for i := range out {
		v := float64(poisson(r, d.Alpha))
		if d.Max > 0 {
			v = math.Min(v, d.Max)
		}
		out[i] = roundInt(v)
	}
	return out
}

// String implements Distribution.
func (d Poisson) String() string {
	return fmt.Sprintf("Poisson[alpha=%s, max=%s]", fmtNum(d.Alpha), fmtMax(d.Max))
}

// poisson draws one Poisson(lam) value: by multiplying uniforms for small lam, by Hörmann's
// transformed rejection (PTRS, 1993) otherwise.
func poisson(r *rand.Rand, lam float64) int64 {
	if lam <= 0 {
		return 0
	}
	if lam < 10 {
		limit, p, k := math.Exp(-lam), 1.0, int64(0)
		for {
			p *= r.Float64()
			if p <= limit {
				return k
			}
			k++
		}
	}
	slam, loglam := math.Sqrt(lam), math.Log(lam)
	b := 0.931 + 2.53*slam
	a := -0.059 + 0.02483*b
	invAlpha := 1.1239 + 1.1328/(b-3.4)
	vr := 0.9277 - 3.6224/(b-2)
	for {
		u := r.Float64() - 0.5
		v := r.Float64()
		us := 0.5 - math.Abs(u)
		k := math.Floor((2*a/us+b)*u + lam + 0.43)
		if us >= 0.07 && v <= vr {
			return int64(k)
		}
		if k < 0 || (us < 0.013 && v > us) {
			continue
		}
		lg, _ := math.Lgamma(k + 1)
		if math.Log(v)+math.Log(invAlpha)-math.Log(a/(us*us)+b) <= -lam+k*loglam-lg {
			return int64(k)
		}
	}
}

// parseDistribution reads one distribution object; name ("prompt_input.num_turns") prefixes
// every error.
func parseDistribution(name string, raw json.RawMessage) (Distribution, error) {
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(raw, &obj); err != nil || obj == nil {
		return nil, configErr(name, "must be an object like {\"distribution\": \"uniform\", \"min\": 1, \"max\": 10}")
	}
	var kind string
	if v, ok := obj["distribution"]; !ok {
		return nil, configErr(name, `missing key "distribution" (constant, uniform, lognormal, zipf or poisson)`)
	} else if err := json.Unmarshal(v, &kind); err != nil {
		return nil, configErr(name+".distribution", "must be a string")
	}
	d := distObject{name: name, kind: kind, obj: obj}
	switch kind {
	case "constant":
		return d.constant()
	case "uniform":
		return d.uniform()
	case "lognormal":
		return d.lognormal()
	case "zipf":
		return d.zipf()
	case "poisson":
		return d.poisson()
	}
	return nil, configErr(name+".distribution", fmt.Sprintf("unknown distribution %q (want constant, uniform, lognormal, zipf or poisson)", kind))
}

// distObject is a distribution object being parsed: its keys, its kind (the "distribution"
// key) and the name that prefixes its errors.
type distObject struct {
	name, kind string
	obj        map[string]json.RawMessage
}

// num reads the number at key: its value, whether it was given and whether it is written as an
// integer. A missing key is an error when required.
func (d distObject) num(key string, required bool) (v float64, given, isInt bool, err error) {
	raw, ok := d.obj[key]
	if !ok {
		if required {
			return 0, false, false, configErr(d.name, fmt.Sprintf("missing key %q (distribution %q)", key, d.kind))
		}
		return 0, false, false, nil
	}
	var n json.Number
	if t := bytes.TrimSpace(raw); len(t) > 0 && t[0] == '"' {
		return 0, false, false, configErr(d.name+"."+key, "must be a number, got "+string(raw))
	}
	if err := json.Unmarshal(raw, &n); err != nil {
		return 0, false, false, configErr(d.name+"."+key, "must be a number, got "+string(raw))
	}
	f, err := n.Float64()
	if err != nil || math.IsInf(f, 0) || math.IsNaN(f) {
		return 0, false, false, configErr(d.name+"."+key, "must be a finite number, got "+n.String())
	}
	return f, true, !strings.ContainsAny(n.String(), ".eE"), nil
}

// required reads the number at key, which must be given.
func (d distObject) required(key string) (float64, error) {
	v, _, _, err := d.num(key, true)
	return v, err
}

// optMax reads the optional, non-negative "max" (0 when not given).
func (d distObject) optMax() (float64, error) {
	m, ok, _, err := d.num("max", false)
	if err != nil {
		return 0, err
	}
	if ok && m < 0 {
		return 0, configErr(d.name+".max", "must not be negative")
	}
	return m, nil
}

// constant reads {"distribution": "constant", "value": v}, v ≥ 0.
func (d distObject) constant() (Distribution, error) {
	v, err := d.required("value")
	if err != nil {
		return nil, err
	}
	if v < 0 {
		return nil, configErr(d.name+".value", "must not be negative")
	}
	return Constant{Value: v}, nil
}

// uniform reads a uniform over [min, max], 0 < min ≤ max; integer when both are written so.
func (d distObject) uniform() (Distribution, error) {
	lo, _, loInt, err := d.num("min", true)
	if err != nil {
		return nil, err
	}
	hi, _, hiInt, err := d.num("max", true)
	if err != nil {
		return nil, err
	}
	if lo <= 0 {
		return nil, configErr(d.name+".min", fmt.Sprintf("must be > 0, got %s", fmtNum(lo)))
	}
	if lo > hi {
		return nil, configErr(d.name, fmt.Sprintf("min %s is larger than max %s", fmtNum(lo), fmtNum(hi)))
	}
	return Uniform{Min: lo, Max: hi, Integer: loInt && hiInt}, nil
}

// lognormal reads a lognormal given either by "average" (and optional "median_ratio") or by
// "mean" and "sigma".
func (d distObject) lognormal() (Distribution, error) {
	m, err := d.optMax()
	if err != nil {
		return nil, err
	}
	if avg, ok, _, err := d.num("average", false); err != nil {
		return nil, err
	} else if ok {
		return d.lognormalAverage(avg, m)
	}
	mean, err := d.required("mean")
	if err != nil {
		return nil, err
	}
	sigma, err := d.required("sigma")
	if err != nil {
		return nil, err
	}
	if mean <= 0 {
		return nil, configErr(d.name+".mean", fmt.Sprintf("must be > 0, got %s", fmtNum(mean)))
	}
	if sigma < 0 {
		return nil, configErr(d.name+".sigma", fmt.Sprintf("must not be negative, got %s", fmtNum(sigma)))
	}
	return Lognormal{Mean: mean, Sigma: sigma, Max: m}, nil
}

// lognormalAverage reads the rest of a lognormal given by its average avg, capped at m.
func (d distObject) lognormalAverage(avg, m float64) (Distribution, error) {
	if _, has := d.obj["mean"]; has {
		return nil, configErr(d.name, `give either "average" (and optional "median_ratio") or "mean" and "sigma", not both`)
	}
	if _, has := d.obj["sigma"]; has {
		return nil, configErr(d.name, `give either "average" (and optional "median_ratio") or "mean" and "sigma", not both`)
	}
	if avg < 1 {
		return nil, configErr(d.name+".average", fmt.Sprintf("must be ≥ 1, got %s", fmtNum(avg)))
	}
	ratio, ok, _, err := d.num("median_ratio", false)
	if err != nil {
		return nil, err
	}
	if !ok {
		ratio = 0.85
	}
	if ratio <= 0 || ratio >= 1 {
		return nil, configErr(d.name+".median_ratio", fmt.Sprintf("must be in (0, 1), got %s", fmtNum(ratio)))
	}
	return Lognormal{Average: avg, MedianRatio: ratio, Max: m}, nil
}

// zipf reads a Zipf with alpha > 1 and an optional max.
func (d distObject) zipf() (Distribution, error) {
	alpha, err := d.required("alpha")
	if err != nil {
		return nil, err
	}
	if alpha <= 1 {
		return nil, configErr(d.name+".alpha", fmt.Sprintf("must be > 1, got %s", fmtNum(alpha)))
	}
	m, err := d.optMax()
	if err != nil {
		return nil, err
	}
	return Zipf{Alpha: alpha, Max: m}, nil
}

// poisson reads a Poisson with alpha ≥ 0 and an optional max.
func (d distObject) poisson() (Distribution, error) {
	alpha, err := d.required("alpha")
	if err != nil {
		return nil, err
	}
	if alpha < 0 {
		return nil, configErr(d.name+".alpha", fmt.Sprintf("must not be negative, got %s", fmtNum(alpha)))
	}
	m, err := d.optMax()
	if err != nil {
		return nil, err
	}
	return Poisson{Alpha: alpha, Max: m}, nil
}

// roundInt rounds v to the nearest integer (halves away from zero), saturating at the int range.
func roundInt(v float64) int {
	v = math.Round(v)
	if v >= math.MaxInt32 {
		return math.MaxInt32
	}
	if v <= math.MinInt32 {
		return math.MinInt32
	}
	return int(v)
}

// fmtNum prints a parameter without trailing zeros.
func fmtNum(v float64) string {
	return fmt.Sprintf("%g", v)
}

// fmtMax prints an optional cap ("none" when unset).
func fmtMax(v float64) string {
	if v <= 0 {
		return "none"
	}
	return fmtNum(v)
}
