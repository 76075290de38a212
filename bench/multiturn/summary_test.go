package multiturn

import (
	"encoding/json"
	"math"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func near(a, b float64) bool { return math.Abs(a-b) < 1e-9*math.Max(1, math.Abs(b)) }

func TestDescribeHandComputed(t *testing.T) {
	// 1..10 (shuffled): mean 5.5; sample variance 82.5/9; numpy-linear quantiles at q·(n−1).
	vals := []float64{7, 3, 10, 1, 9, 2, 8, 5, 4, 6}
	s := Describe(vals, PercentilesFor(len(vals)))
	if s.Count != 10 || !near(s.Mean, 5.5) || !near(s.Std, math.Sqrt(82.5/9)) || s.Min != 1 || s.Max != 10 {
		t.Errorf("describe = %+v", s)
	}
	want := map[float64]float64{0.25: 3.25, 0.5: 5.5, 0.75: 7.75, 0.9: 9.1}
	if len(s.Percentiles) != 4 {
		t.Fatalf("percentiles %v", s.Percentiles)
	}
	for q, w := range want {
		if got, ok := s.Percentile(q); !ok || !near(got, w) {
			t.Errorf("p%v = %v, want %v", q, got, w)
		}
	}
	// {2, 4, 4, 4, 5, 5, 7, 9}: mean 5, sample std sqrt(32/7), median 4.5, p90 at rank 6.3 → 7.6.
	s = Describe([]float64{2, 4, 4, 4, 5, 5, 7, 9}, []float64{0.5, 0.9})
	if !near(s.Mean, 5) || !near(s.Std, math.Sqrt(32.0/7)) {
		t.Errorf("mean %v std %v", s.Mean, s.Std)
	}
	if p, _ := s.Percentile(0.5); !near(p, 4.5) {
		t.Errorf("median %v", p)
	}
	if p, _ := s.Percentile(0.9); !near(p, 7.6) {
		t.Errorf("p90 %v", p)
	}
	// One value: std is NaN (pandas); no values: all NaN.
	if s := Describe([]float64{3}, []float64{0.5}); !math.IsNaN(s.Std) || s.Mean != 3 || s.Percentiles[0].Value != 3 {
		t.Errorf("single: %+v", s)
	}
	if s := Describe(nil, []float64{0.5}); s.Count != 0 || !math.IsNaN(s.Mean) {
		t.Errorf("empty: %+v", s)
	}
	// Extra percentiles by sample count.
	for n, want := range map[int]int{99: 4, 100: 5, 999: 5, 1000: 6, 10000: 7} {
		if got := len(PercentilesFor(n)); got != want {
			t.Errorf("PercentilesFor(%d) has %d, want %d", n, got, want)
		}
	}
	labels := []string{}
	for _, q := range PercentilesFor(10000) {
		labels = append(labels, Percentile{Q: q}.Label())
	}
	if strings.Join(labels, " ") != "25% 50% 75% 90% 99% 99.9% 99.99%" {
		t.Errorf("labels %v", labels)
	}
}

func TestStatJSONRoundTrip(t *testing.T) {
	s := Describe([]float64{1}, []float64{0.25, 0.999})
	b, err := json.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	if string(b) != `{"count":1,"mean":1,"std":null,"min":1,"25%":1,"99.9%":1,"max":1}` {
		t.Errorf("json %s", b)
	}
	var back Stat
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if back.Count != 1 || !math.IsNaN(back.Std) || len(back.Percentiles) != 2 || !near(back.Percentiles[1].Q, 0.999) {
		t.Errorf("round trip %+v", back)
	}
}

func TestTokenTimings(t *testing.T) {
	// 10 output tokens, the first chunk held 3: TPOT = (100−40)/(10−3); TTFT = 40 − 2·TPOT.
	ttft, tpot := tokenTimings(40, 100, 10, 3)
	if !near(tpot, 60.0/7) || !near(ttft, 40-2*60.0/7) {
		t.Errorf("ttft %v tpot %v", ttft, tpot)
	}
	// One chunk with everything: TPOT 0, TTFT unchanged... but k > 1 with TPOT 0 keeps TTFT.
	if ttft, tpot := tokenTimings(50, 50, 5, 5); tpot != 0 || ttft != 50 {
		t.Errorf("single chunk: %v %v", ttft, tpot)
	}
	// The correction is floored at 0.1 ms.
	if ttft, _ := tokenTimings(1, 1000, 20, 10); ttft != 0.1 {
		t.Errorf("floor: %v", ttft)
	}
	if ttft, tpot := tokenTimings(5, 9, 1, 1); ttft != 5 || tpot != 0 {
		t.Errorf("one token: %v %v", ttft, tpot)
	}
}

// synthetic returns n samples, 100 ms apart, 50 ms long, turn i%3+1, ttft 10·turn.
func synthetic(n int) []RequestStats {
	var out []RequestStats
	for i := range n {
		turn := i%3 + 1
		out = append(out, RequestStats{
			TTFTMs: float64(10 * turn), TPOTMs: 2, LatencyMs: 50, StartTimeMs: float64(100 * i),
			InputNumTurns: 2*turn - 1, InputNumTokens: 100 * turn, OutputNumTokens: 20, OutputNumChunks: 19,
			ConversationID: "c", ClientID: 0,
		})
	}
	// Arrival order differs from start order: Summarize must sort.
	out[0], out[1] = out[1], out[0]
	return out
}

func TestSummarize(t *testing.T) {
	res := &Result{Samples: synthetic(10), NumConversations: 4, Failures: 1, ActiveConversations: 2, WarmupRuntime: 2 * time.Second}
	opts := Options{NumClients: 2, Seed: 3, LimitMinTokens: 5, LimitMaxTokens: 9, URL: "http://x", Tokens: EstimateTokenCounter("test")}
	s := Summarize(res, ReportInfo{Model: "m", Options: opts, WarmupPercentages: []float64{0.5, 0}})
	if len(s.Windows) != 2 || s.Windows[0].WarmupPercent != 0 || s.Windows[1].WarmupPercent != 50 {
		t.Fatalf("windows %+v", s.Windows)
	}
	// 0 %: first start 0, last end 900+50 → 0.95 s, 10/0.95 req/s.
	if !near(s.RuntimeSec, 0.95) || !near(s.RequestsPerSec, 10/0.95) {
		t.Errorf("runtime %v rps %v", s.RuntimeSec, s.RequestsPerSec)
	}
	// 50 %: the 5 latest (starts 500..900) → 0.45 s.
	if w := s.Windows[1]; w.NumSamples != 5 || !near(w.RuntimeSec, 0.45) || w.Metrics["ttft_ms"].Count != 5 {
		t.Errorf("window 50%%: %+v", w)
	}
	if st := s.Metrics["input_num_turns"]; st.Min != 1 || st.Max != 5 || st.Count != 10 {
		t.Errorf("input_num_turns %+v", st)
	}
	// Turns: 1 → samples 0,3,6,9 (ttft 10); 2 → 1,4,7 (20); 3 → 2,5,8 (30).
	if len(s.TTFTMsByTurn) != 3 || *s.TTFTMsByTurn[0] != 10 || *s.TTFTMsByTurn[2] != 30 || s.RequestsByTurn[0] != 4 || s.RequestsByTurn[1] != 3 {
		t.Errorf("by turn %v %v", s.TTFTMsByTurn, s.RequestsByTurn)
	}
	if *s.WarmupRuntimeSec != 2 || !near(*s.TotalRuntimeInclWarmupSec, 2.95) {
		t.Errorf("warmup %v total %v", *s.WarmupRuntimeSec, *s.TotalRuntimeInclWarmupSec)
	}

	var b strings.Builder
	if err := WriteReport(&b, s); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	// Compare with runs of spaces collapsed (column widths are not part of the contract).
	lines := strings.Split(out, "\n")
	for i, l := range lines {
		lines[i] = strings.Join(strings.Fields(l), " ")
	}
	out = strings.Join(lines, "\n")
	for _, want := range []string{
		"Parameters:\nmodel=m\nnum_clients=2\nnum_conversations=4\nactive_conversations=2\nseed=3\nmin_tokens=5\nmax_tokens=9\n",
		"Statistics summary (assuming 0% warmup samples):\nruntime_sec = 0.950\nrequests_per_sec = 10.526\n",
		"Statistics summary (assuming 50% warmup samples):",
		"warmup_runtime_sec = 2.000",
		"count mean std min 25% 50% 75% 90% max",
		"ttft_ms 10.0 19.00 8.76 10.0 10.0 20.0 27.50 30.0 30.0",
		"failed_requests = 1",
		"token_counter=estimate",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}

	// JSON round trip.
	p := filepath.Join(t.TempDir(), "s.json")
	if err := WriteSummaryJSON(p, s); err != nil {
		t.Fatal(err)
	}
	back, err := ReadSummaryJSON(p)
	if err != nil {
		t.Fatal(err)
	}
	if back.NumRequests != 10 || len(back.TTFTMsByTurn) != 3 || back.Metrics["ttft_ms"].Count != 10 || back.Parameters[0].Key == "" {
		t.Errorf("read back %+v", back)
	}
	var cmp strings.Builder
	if err := WriteComparison(&cmp, "a", "b", s, back); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(cmp.String(), "ttft_ms mean") || !strings.Contains(cmp.String(), "1.000") {
		t.Errorf("comparison:\n%s", cmp.String())
	}
}

func TestParseWarmupPercentages(t *testing.T) {
	got, err := ParseWarmupPercentages("50%, 0%,25")
	if err != nil || len(got) != 3 || got[0] != 0 || got[1] != 0.25 || got[2] != 0.5 {
		t.Errorf("%v %v", got, err)
	}
	for _, bad := range []string{"100%", "-1%", "x", ""} {
		if _, err := ParseWarmupPercentages(bad); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}
