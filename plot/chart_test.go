package plot

import (
	"bytes"
	"encoding/xml"
	"errors"
	"io"
	"math"
	"strconv"
	"strings"
	"testing"
)

// element is a parsed SVG element with its attributes and the text of its <title> child.
type element struct {
	name  string
	attrs map[string]string
	group string // data-name of the enclosing series group, if any
}

// parseSVG checks that doc is well-formed XML with an <svg> root and returns its elements.
func parseSVG(t *testing.T, doc []byte) []element {
	t.Helper()
	dec := xml.NewDecoder(bytes.NewReader(doc))
	var out []element
	var stack []string
	var groups []string
	root := ""
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("svg is not well-formed: %v\n%s", err, doc)
		}
		switch tk := tok.(type) {
		case xml.StartElement:
			if root == "" {
				root = tk.Name.Local
			}
			e := element{name: tk.Name.Local, attrs: map[string]string{}}
			for _, a := range tk.Attr {
				e.attrs[a.Name.Local] = a.Value
			}
			if len(groups) > 0 {
				e.group = groups[len(groups)-1]
			}
			if tk.Name.Local == "g" {
				groups = append(groups, e.attrs["data-name"])
			}
			stack = append(stack, tk.Name.Local)
			out = append(out, e)
		case xml.EndElement:
			if tk.Name.Local == "g" {
				groups = groups[:len(groups)-1]
			}
			stack = stack[:len(stack)-1]
		}
	}
	if root != "svg" || len(stack) != 0 {
		t.Fatalf("root %q, unclosed %v", root, stack)
	}
	return out
}

func attrF(t *testing.T, e element, k string) float64 {
	t.Helper()
	v, err := strconv.ParseFloat(e.attrs[k], 64)
	if err != nil {
		t.Fatalf("%s %s=%q: %v", e.name, k, e.attrs[k], err)
	}
	return v
}

func TestLineChartWellFormedAndMonotonic(t *testing.T) {
	a := []float64{10, 40, 20, 80, 55}
	b := []float64{12, 11, math.NaN(), 9, 8}
	var buf bytes.Buffer
	err := LineChart(&buf, Chart{
		Title: "TTFT per turn <one-way & bidirectional>", XLabel: "turn", YLabel: "TTFT (ms)",
		Series: []Series{{Name: "one-way", Y: a}, {Name: `bi"directional`, Y: b}},
	})
	if err != nil {
		t.Fatal(err)
	}
	els := parseSVG(t, buf.Bytes())
	pts := map[string][][2]float64{}
	for _, e := range els {
		if e.name == "circle" && e.group != "" {
			pts[e.group] = append(pts[e.group], [2]float64{attrF(t, e, "cx"), attrF(t, e, "cy")})
		}
	}
	if len(pts["one-way"]) != 5 || len(pts[`bi"directional`]) != 4 {
		t.Fatalf("points: %v", pts)
	}
	// x increases with the index; y pixel order is the reverse of value order.
	p := pts["one-way"]
	for i := range p {
		for j := range p {
			if i < j && !(p[i][0] < p[j][0]) {
				t.Errorf("x not increasing: %v", p)
			}
			if a[i] < a[j] && !(p[i][1] > p[j][1]) {
				t.Errorf("value %v < %v but pixel y %v <= %v", a[i], a[j], p[i][1], p[j][1])
			}
		}
	}
	// Both series share the x positions (turn 4 of b is at the x of turn 4 of a).
	if pts[`bi"directional`][2][0] != p[3][0] {
		t.Errorf("x of turn 4 differs: %v vs %v", pts[`bi"directional`][2][0], p[3][0])
	}
	s := buf.String()
	for _, want := range []string{"one-way", "turn", "TTFT (ms)", "&lt;one-way &amp; bidirectional&gt;"} {
		if !strings.Contains(s, want) {
			t.Errorf("svg lacks %q", want)
		}
	}
	// The NaN splits series b into two polylines (1 with two points, 1 with two points).
	n := 0
	for _, e := range els {
		if e.name == "polyline" && e.group == `bi"directional` {
			n++
		}
	}
	if n != 2 {
		t.Errorf("polylines for series with a gap = %d, want 2", n)
	}
}

func TestBarChartWellFormedAndMonotonic(t *testing.T) {
	vals := [][]float64{{5, 1, 3}, {2, 4, -1}}
	var buf bytes.Buffer
	err := BarChart(&buf, Chart{
		Title: "bars", Categories: []string{"p50", "p90", "p99"},
		Series: []Series{{Name: "A", Y: vals[0]}, {Name: "B", Y: vals[1]}},
		Width:  400, Height: 300,
	})
	if err != nil {
		t.Fatal(err)
	}
	els := parseSVG(t, buf.Bytes())
	type bar struct{ x, y, h float64 }
	bars := map[string][]bar{}
	for _, e := range els {
		if e.name == "rect" && e.group != "" {
			bars[e.group] = append(bars[e.group], bar{attrF(t, e, "x"), attrF(t, e, "y"), attrF(t, e, "height")})
		}
	}
	if len(bars["A"]) != 3 || len(bars["B"]) != 3 {
		t.Fatalf("bars: %v", bars)
	}
	// Height grows with |value| for positive values; bars of group i lie left of group i+1.
	all := []struct {
		v float64
		b bar
	}{}
	for si, name := range []string{"A", "B"} {
		for i, b := range bars[name] {
			all = append(all, struct {
				v float64
				b bar
			}{vals[si][i], b})
			if i > 0 && !(bars[name][i-1].x < b.x) {
				t.Errorf("%s: group order broken", name)
			}
		}
	}
	for _, p := range all {
		for _, q := range all {
			if p.v > 0 && q.v > 0 && p.v < q.v && !(p.b.h < q.b.h) {
				t.Errorf("value %v < %v but height %v >= %v", p.v, q.v, p.b.h, q.b.h)
			}
		}
	}
	// The negative bar starts at the zero line, where the positive bars end.
	neg := bars["B"][2]
	posBottom := bars["A"][0].y + bars["A"][0].h
	if math.Abs(neg.y-posBottom) > 0.02 {
		t.Errorf("negative bar top %v, zero line %v", neg.y, posBottom)
	}
	if !strings.Contains(buf.String(), "p90") {
		t.Error("category label missing")
	}
}

func TestErrors(t *testing.T) {
	var buf bytes.Buffer
	if err := LineChart(&buf, Chart{}); !errors.Is(err, ErrNoData) {
		t.Errorf("no series: %v", err)
	}
	if err := BarChart(&buf, Chart{Series: []Series{{Name: "x", Y: []float64{math.NaN()}}}}); !errors.Is(err, ErrNoData) {
		t.Errorf("all NaN: %v", err)
	}
	if err := LineChart(&buf, Chart{Series: []Series{{Name: "x", Y: []float64{1, math.Inf(1)}}}}); !errors.Is(err, ErrBadValue) {
		t.Errorf("inf: %v", err)
	}
}

func TestSinglePointAndManyPoints(t *testing.T) {
	for _, n := range []int{1, 3, 200} {
		y := make([]float64, n)
		for i := range y {
			y[i] = 7 // constant, including zero-range data
		}
		var buf bytes.Buffer
		if err := LineChart(&buf, Chart{Series: []Series{{Name: "c", Y: y}}}); err != nil {
			t.Fatal(err)
		}
		parseSVG(t, buf.Bytes())
		buf.Reset()
		if err := BarChart(&buf, Chart{Series: []Series{{Name: "c", Y: y}}}); err != nil {
			t.Fatal(err)
		}
		parseSVG(t, buf.Bytes())
	}
}

func TestNiceRange(t *testing.T) {
	lo, hi, ticks := niceRange(0, 87, 5, false)
	if lo != 0 || hi != 100 || len(ticks) != 6 || ticks[1] != 20 {
		t.Errorf("niceRange(0,87) = %v %v %v", lo, hi, ticks)
	}
	lo, hi, ticks = niceRange(-3, 0.7, 5, false)
	if lo > -3 || hi < 0.7 || ticks[0] != lo {
		t.Errorf("niceRange(-3,0.7) = %v %v %v", lo, hi, ticks)
	}
}
