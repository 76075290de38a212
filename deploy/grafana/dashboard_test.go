package grafana_test

import (
	"encoding/json"
	"net/http"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/kvbridge/kvbridge/apiclient"
	"github.com/kvbridge/kvbridge/internal/fixture"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/stack"
)

// dashboard is the part of Grafana's dashboard JSON model the test checks.
type dashboard struct {
	Title         string  `json:"title"`
	UID           string  `json:"uid"`
	SchemaVersion int     `json:"schemaVersion"`
	Panels        []panel `json:"panels"`
	Templating    struct {
		List []struct {
			Name  string `json:"name"`
			Type  string `json:"type"`
			Query any    `json:"query"`
		} `json:"list"`
	} `json:"templating"`
}

type panel struct {
	ID         int    `json:"id"`
	Type       string `json:"type"`
	Title      string `json:"title"`
	Datasource struct {
		Type string `json:"type"`
		UID  string `json:"uid"`
	} `json:"datasource"`
	GridPos struct{ H, W, X, Y int } `json:"gridPos"`
	Targets []target                 `json:"targets"`
}

type target struct {
	Expr  string `json:"expr"`
	RefID string `json:"refId"`
}

// readDashboard decodes kvbridge-pd.json strictly enough to catch a broken file: the fields
// Grafana needs to import it, a Prometheus data source variable that every panel uses, panels
// on the 24-column grid without overlaps, and a query in every target.
func readDashboard(t *testing.T) dashboard {
	t.Helper()
	raw, err := os.ReadFile("kvbridge-pd.json")
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatalf("kvbridge-pd.json: %v", err)
	}
	if d.Title == "" || d.UID == "" || d.SchemaVersion < 30 || len(d.Panels) == 0 {
		t.Fatalf("not a Grafana dashboard: title %q, uid %q, schemaVersion %d, %d panels", d.Title, d.UID, d.SchemaVersion, len(d.Panels))
	}
	dsVar := ""
	for _, v := range d.Templating.List {
		if v.Type == "datasource" && v.Query == "prometheus" {
			dsVar = "${" + v.Name + "}"
		}
	}
	if dsVar == "" {
		t.Fatal("no Prometheus data source variable in templating")
	}
	ids := map[int]bool{}
	var cells [][24]bool // occupied grid cells, by row
	for _, p := range d.Panels {
		if ids[p.ID] || p.Type == "" || p.Title == "" {
			t.Errorf("panel %d %q: duplicate id, or no type or title", p.ID, p.Title)
		}
		ids[p.ID] = true
		if p.Datasource.Type != "prometheus" || p.Datasource.UID != dsVar {
			t.Errorf("panel %q: data source %+v, want the variable %s", p.Title, p.Datasource, dsVar)
		}
		g := p.GridPos
		if g.W < 1 || g.H < 1 || g.X < 0 || g.Y < 0 || g.X+g.W > 24 {
			t.Errorf("panel %q: gridPos %+v off the 24-column grid", p.Title, g)
			continue
		}
		for len(cells) < g.Y+g.H {
			cells = append(cells, [24]bool{})
		}
		for y := g.Y; y < g.Y+g.H; y++ {
			for x := g.X; x < g.X+g.W; x++ {
				if cells[y][x] {
					t.Errorf("panel %q overlaps another at (%d, %d)", p.Title, x, y)
				}
				cells[y][x] = true
			}
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q queries nothing", p.Title)
		}
		for _, tg := range p.Targets {
			if strings.TrimSpace(tg.Expr) == "" || tg.RefID == "" {
				t.Errorf("panel %q: target %+v without a query or refId", p.Title, tg)
			}
		}
	}
	return d
}

// seriesName matches the series a PromQL expression names: vLLM's and kvbridge's.
var seriesName = regexp.MustCompile(`\b(?:vllm|kvbridge):[A-Za-z0-9_:]+`)

// startPD starts a one-way P/D stack of kvbridge/tiny and a client for it; both are closed, and
// every pool checked full, when the test ends.
func startPD(t *testing.T) (*stack.Stack, *http.Client) {
	t.Helper()
	m, err := stack.OpenModel(t.Context(), model.Tiny, nil)
	if err != nil {
		t.Fatal(err)
	}
	s, err := stack.Start(t.Context(), stack.Config{Model: m, NumBlocks: 128, MaxModelLen: 1024})
	if err != nil {
		m.Close()
		t.Fatal(err)
	}
	hc := &http.Client{Transport: stack.NewTransport(2)}
	t.Cleanup(func() {
		hc.CloseIdleConnections()
		if err := s.Close(); err != nil {
			t.Error(err)
		}
		if err := s.CheckPools(); err != nil {
			t.Error(err)
		}
		m.Close()
	})
	return s, hc
}

// pd sends a completion of prompt through s's proxy and fails t unless it succeeds.
func pd(t *testing.T, s *stack.Stack, hc *http.Client, prompt string) apiclient.Reply {
	t.Helper()
	body := map[string]any{"model": model.Tiny, "prompt": prompt, "max_tokens": 5, "temperature": 0}
	r, err := apiclient.Post(t.Context(), hc, s.URL+"/v1/completions", body, nil)
	if err != nil || r.Check(s.URL) != nil {
		t.Fatalf("P/D request: %v %v", err, r.Check(s.URL))
	}
	return r
}

// TestDashboardSeriesExist: every series the dashboard's panels query is served by a running P
// and D after a P/D request through the proxy; a panel over a series the engines do not export
// (a typo, a renamed series, a histogram queried without its _bucket) would be empty forever.
func TestDashboardSeriesExist(t *testing.T) {
	d := readDashboard(t)
	s, hc := startPD(t)
	pd(t, s, hc, "A dashboard is only as good as the series behind its panels.")
	engines := map[string]fixture.Samples{"P": fixture.Scrape(t, hc, s.P.URL()), "D": fixture.Scrape(t, hc, s.D.URL())}
	queried := 0
	for _, p := range d.Panels {
		for _, tg := range p.Targets {
			names := seriesName.FindAllString(tg.Expr, -1)
			if len(names) == 0 {
				t.Errorf("panel %q: %q names no vllm: or kvbridge: series", p.Title, tg.Expr)
			}
			for _, name := range names {
				queried++
				for role, served := range engines {
					if len(served[name]) == 0 {
						t.Errorf("panel %q queries %s, which %s does not export", p.Title, name, role)
					}
				}
			}
		}
	}
	t.Logf("%d panels, %d series queried", len(d.Panels), queried)
	// The panels the task is about are there.
	for _, want := range []string{"vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
		"vllm:request_decode_time_seconds_sum", "vllm:time_to_first_token_seconds_bucket", "vllm:nixl_bytes_transferred_sum",
		"vllm:prompt_tokens_by_source_total", "vllm:nixl_num_kv_expired_reqs_total", "kvbridge:decoder_holds_expired_total",
		"vllm:nixl_num_failed_transfers_total", "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"} {
		if !slices.ContainsFunc(d.Panels, func(p panel) bool {
			return slices.ContainsFunc(p.Targets, func(tg target) bool {
				return slices.Contains(seriesName.FindAllString(tg.Expr, -1), want)
			})
		}) {
			t.Errorf("no panel queries %s", want)
		}
	}
}
