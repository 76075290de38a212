package plot

import (
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
)

// LineChart writes an SVG line chart of c.Series to w: Y[i] of each series is plotted at
// x = i+1, consecutive present points are joined, and every point gets a marker. It returns
// ErrNoData when there is nothing to draw and ErrBadValue for infinite values.
func LineChart(w io.Writer, c Chart) error {
	n, lo, hi, err := validate(c)
	if err != nil {
		return err
	}
	g := layout(c, lo, hi)
	var cv canvas
	cv.open(g, c.Title)
	cv.frame(g, c)

	// x = 1..n spread over the plot area with half a step of padding at both ends.
	step := (g.right - g.left) / float64(n)
	xPix := func(x int) float64 { return g.left + step*(float64(x)-0.5) }
	stride := xTickStride(n, g.right-g.left)
	for x := 1; x <= n; x++ {
		px := xPix(x)
		cv.line(px, g.bot, px, g.bot+5, "black", 1, "")
		if (x-1)%stride != 0 {
			continue
		}
		label := strconv.Itoa(x)
		if x-1 < len(c.Categories) && c.Categories[x-1] != "" {
			label = c.Categories[x-1]
		}
		cv.text(px, g.bot+18, "middle", "", label)
	}

	for i, s := range c.Series {
		col := colorOf(s, i)
		fmt.Fprintf(&cv.buf, `<g class="series" data-name="%s">`+"\n", attr(s.Name))
		// One polyline per run of present points (NaN breaks the line).
		var pts []string
		flush := func() {
			if len(pts) > 1 {
				fmt.Fprintf(&cv.buf, `<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>`+"\n", col, strings.Join(pts, " "))
			}
			pts = pts[:0]
		}
		for j, v := range s.Y {
			if math.IsNaN(v) {
				flush()
				continue
			}
			pts = append(pts, num(xPix(j+1))+","+num(g.yPix(v)))
		}
		flush()
		for j, v := range s.Y {
			if math.IsNaN(v) {
				continue
			}
			fmt.Fprintf(&cv.buf, `<circle cx="%s" cy="%s" r="3.5" fill="%s"><title>`, num(xPix(j+1)), num(g.yPix(v)), col)
			cv.escape(fmt.Sprintf("%s x=%d: %s", s.Name, j+1, trimFloat(v)))
			cv.buf.WriteString("</title></circle>\n")
		}
		cv.buf.WriteString("</g>\n")
	}
	cv.legend(g, c.Series, "line")
	cv.close()
	return cv.write(w)
}

// attr escapes s for use inside a double-quoted attribute.
func attr(s string) string {
	var b strings.Builder
	for _, r := range s {
		switch r {
		case '&':
			b.WriteString("&amp;")
		case '<':
			b.WriteString("&lt;")
		case '>':
			b.WriteString("&gt;")
		case '"':
			b.WriteString("&quot;")
		default:
			if r < 0x20 {
				b.WriteByte(' ')
				continue
			}
			b.WriteRune(r)
		}
	}
	return b.String()
}
