package plot

import (
	"bytes"
	"encoding/xml"
	"fmt"
	"io"
	"math"
)

// canvas accumulates an SVG document; write sends it to the destination in one call.
type canvas struct {
	buf bytes.Buffer
}

// open starts the document with its size and a white background.
func (c *canvas) open(g geometry, title string) {
	fmt.Fprintf(&c.buf, `<?xml version="1.0" encoding="UTF-8"?>`+"\n")
	fmt.Fprintf(&c.buf, `<svg xmlns="http://www.w3.org/2000/svg" width="%s" height="%s" viewBox="0 0 %s %s" font-family="sans-serif" font-size="12">`+"\n",
		num(g.width), num(g.height), num(g.width), num(g.height))
	if title != "" {
		c.buf.WriteString("<title>")
		c.escape(title)
		c.buf.WriteString("</title>\n")
	}
	fmt.Fprintf(&c.buf, `<rect x="0" y="0" width="%s" height="%s" fill="white"/>`+"\n", num(g.width), num(g.height))
}

// close ends the document.
func (c *canvas) close() { c.buf.WriteString("</svg>\n") }

// write copies the finished document to w.
func (c *canvas) write(w io.Writer) error {
	if _, err := w.Write(c.buf.Bytes()); err != nil {
		return fmt.Errorf("plot: write svg: %w", err)
	}
	return nil
}

// escape writes s with XML special characters escaped.
func (c *canvas) escape(s string) {
	_ = xml.EscapeText(&c.buf, []byte(s)) // writing to a bytes.Buffer cannot fail
}

// text draws s at (x, y); anchor is start, middle or end; extra holds further attributes.
func (c *canvas) text(x, y float64, anchor, extra, s string) {
	fmt.Fprintf(&c.buf, `<text x="%s" y="%s" text-anchor="%s"%s>`, num(x), num(y), anchor, extra)
	c.escape(s)
	c.buf.WriteString("</text>\n")
}

// line draws a straight segment.
func (c *canvas) line(x1, y1, x2, y2 float64, stroke string, width float64, extra string) {
	fmt.Fprintf(&c.buf, `<line x1="%s" y1="%s" x2="%s" y2="%s" stroke="%s" stroke-width="%s"%s/>`+"\n",
		num(x1), num(y1), num(x2), num(y2), stroke, num(width), extra)
}

// frame draws the title, the y grid with tick labels, both axes and the axis labels.
func (c *canvas) frame(g geometry, ch Chart) {
	if ch.Title != "" {
		c.text(g.width/2, 24, "middle", ` font-size="16" font-weight="bold"`, ch.Title)
	}
	for _, t := range g.yticks {
		y := g.yPix(t)
		c.line(g.left, y, g.right, y, "#dddddd", 1, "")
		c.line(g.left-5, y, g.left, y, "black", 1, "")
		c.text(g.left-8, y+4, "end", "", formatTick(t))
	}
	c.line(g.left, g.top, g.left, g.bot, "black", 1, "")
	zero := g.bot
	if g.ymin < 0 && g.ymax > 0 {
		zero = g.yPix(0)
	}
	c.line(g.left, zero, g.right, zero, "black", 1, "")
	if ch.XLabel != "" {
		c.text((g.left+g.right)/2, g.bot+38, "middle", "", ch.XLabel)
	}
	if ch.YLabel != "" {
		cy := (g.top + g.bot) / 2
		c.text(18, cy, "middle", fmt.Sprintf(` transform="rotate(-90 18 %s)"`, num(cy)), ch.YLabel)
	}
}

// legend draws one entry per series below the x-axis label; marker is "line" or "box".
func (c *canvas) legend(g geometry, series []Series, marker string) {
	x0 := g.left
	x, y := x0, g.height-18*float64(g.legendRows)+4
	c.buf.WriteString(`<g class="legend">` + "\n")
	for i, s := range series {
		w := legendEntryWidth(s.Name)
		if x > x0 && x+w > x0+(g.width-140) {
			x = x0
			y += 18
		}
		col := colorOf(s, i)
		if marker == "line" {
			c.line(x, y, x+24, y, col, 2.5, "")
			fmt.Fprintf(&c.buf, `<circle cx="%s" cy="%s" r="3.5" fill="%s"/>`+"\n", num(x+12), num(y), col)
		} else {
			fmt.Fprintf(&c.buf, `<rect x="%s" y="%s" width="24" height="10" fill="%s"/>`+"\n", num(x), num(y-5), col)
		}
		c.text(x+30, y+4, "start", "", s.Name)
		x += w
	}
	c.buf.WriteString("</g>\n")
}

// num formats a coordinate with at most two decimals.
func num(v float64) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return "0"
	}
	return trimFloat(math.Round(v*100) / 100)
}
