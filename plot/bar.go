package plot

import (
	"fmt"
	"io"
	"math"
	"strconv"
)

// BarChart writes an SVG grouped bar chart to w: group i holds one bar per series, Y[i] of that
// series, drawn from 0 (bars of negative values hang below the zero line). Groups are labelled
// with c.Categories, or 1..N where a name is missing. It returns ErrNoData when there is nothing
// to draw and ErrBadValue for infinite values.
func BarChart(w io.Writer, c Chart) error {
	n, lo, hi, err := validate(c)
	if err != nil {
		return err
	}
	n = max(n, len(c.Categories))
	g := layout(c, lo, hi)
	var cv canvas
	cv.open(g, c.Title)
	cv.frame(g, c)

	groupW := (g.right - g.left) / float64(n)
	barW := groupW * 0.8 / float64(len(c.Series))
	zero := g.yPix(math.Max(g.ymin, math.Min(0, g.ymax)))
	stride := xTickStride(n, g.right-g.left)
	for i := 0; i < n; i++ {
		if i%stride != 0 {
			continue
		}
		label := strconv.Itoa(i + 1)
		if i < len(c.Categories) && c.Categories[i] != "" {
			label = c.Categories[i]
		}
		cv.text(g.left+groupW*(float64(i)+0.5), g.bot+18, "middle", "", label)
	}
	for si, s := range c.Series {
		col := colorOf(s, si)
		fmt.Fprintf(&cv.buf, `<g class="series" data-name="%s">`+"\n", attr(s.Name))
		for i, v := range s.Y {
			if math.IsNaN(v) {
				continue
			}
			x := g.left + groupW*float64(i) + groupW*0.1 + barW*float64(si)
			y := g.yPix(v)
			top, h := math.Min(y, zero), math.Abs(zero-y)
			fmt.Fprintf(&cv.buf, `<rect x="%s" y="%s" width="%s" height="%s" fill="%s"><title>`,
				num(x), num(top), num(barW), num(h), col)
			cv.escape(fmt.Sprintf("%s %d: %s", s.Name, i+1, trimFloat(v)))
			cv.buf.WriteString("</title></rect>\n")
		}
		cv.buf.WriteString("</g>\n")
	}
	cv.legend(g, c.Series, "box")
	cv.close()
	return cv.write(w)
}
