package multiturn

import (
	"fmt"
	"io"
	"strings"
	"time"
)

// progress reports a phase's progress: one self-overwriting bar line on a terminal, plain
// lines otherwise (every few finished conversations, and at least every 10 s of activity). It is
// used by the phase's collector goroutine only.
type progress struct {
	w   io.Writer // nil: silent
	bar bool

	name                      string
	total, clients, expected  int
	start, lastLine, lastDraw time.Time
	requests, failures, convs int
	exited                    int
	ttft, tpot                movingAverage
	barShown                  bool
}

// newProgress returns a reporter writing to w (nil: silent).
func newProgress(w io.Writer, bar bool) *progress { return &progress{w: w, bar: bar} }

// movingAverage is the mean of the last len(window) values.
type movingAverage struct {
	window []float64
	next   int
	n      int
	sum    float64
}

// add records v.
func (m *movingAverage) add(v float64) {
	if len(m.window) == 0 {
		return
	}
	if m.n == len(m.window) {
		m.sum -= m.window[m.next]
	} else {
		m.n++
	}
	m.window[m.next] = v
	m.sum += v
	m.next = (m.next + 1) % len(m.window)
}

// avg returns the average (0 without values).
func (m *movingAverage) avg() float64 {
	if m.n == 0 {
		return 0
	}
	return m.sum / float64(m.n)
}

// begin starts a phase of total conversations and at most expected requests.
func (p *progress) begin(name string, total, clients, expected int) {
	win := min(15*clients, 500)
	*p = progress{w: p.w, bar: p.bar, name: name, total: total, clients: clients, expected: expected,
		start: time.Now(), ttft: movingAverage{window: make([]float64, win)}, tpot: movingAverage{window: make([]float64, win)}}
	p.lastLine = p.start
	p.logf("%s: starting %d clients on %d conversations", name, clients, total)
}

// logf prints a message line, keeping the bar below it.
func (p *progress) logf(format string, args ...any) {
	if p.w == nil {
		return
	}
	if p.bar && p.barShown {
		fmt.Fprint(p.w, "\r\033[K")
	}
	fmt.Fprintf(p.w, format+"\n", args...)
	if p.bar && p.barShown {
		p.draw(true)
	}
}

// sample records a measured request.
func (p *progress) sample(s RequestStats) {
	p.requests++
	p.ttft.add(s.TTFTMs)
	p.tpot.add(s.TPOTMs)
	p.tick(false)
}

// failure records a failed request.
func (p *progress) failure() { p.failures++; p.tick(false) }

// finished records a finished conversation.
func (p *progress) finished() {
	p.convs++
	cycle := max(3, p.clients/4)
	p.tick(p.convs%cycle == 0)
}

// clientExited records a client that stopped.
func (p *progress) clientExited() { p.exited++; p.tick(false) }

// end closes the phase's progress output.
func (p *progress) end() {
	if p.w == nil {
		return
	}
	if p.bar {
		p.draw(true)
		fmt.Fprintln(p.w)
		p.barShown = false
		return
	}
	p.line()
}

// tick redraws the bar (at most 10 times a second) or prints a plain line when due.
func (p *progress) tick(lineDue bool) {
	if p.w == nil {
		return
	}
	if p.bar {
		p.draw(false)
		return
	}
	if lineDue || time.Since(p.lastLine) >= 10*time.Second {
		p.line()
	}
}

// fraction is the phase's completion in [0, 1]: requests made of the most the phase can make
// (an early stop ends it sooner).
func (p *progress) fraction() float64 {
	if p.expected <= 0 {
		return 0
	}
	return min(float64(p.requests+p.failures)/float64(p.expected), 1)
}

// status is the numbers shown on every progress output.
func (p *progress) status() string {
	s := fmt.Sprintf("%d/%d requests, %d/%d conversations done", p.requests, p.expected, p.convs, p.total)
	if p.failures > 0 {
		s += fmt.Sprintf(" (%d failed)", p.failures)
	}
	if p.ttft.n > 0 {
		s += fmt.Sprintf(", ttft %.1f ms, tpot %.2f ms", p.ttft.avg(), p.tpot.avg())
	}
	return s + fmt.Sprintf(", %.1f s", time.Since(p.start).Seconds())
}

// draw renders the bar line.
func (p *progress) draw(force bool) {
	if !force && time.Since(p.lastDraw) < 100*time.Millisecond {
		return
	}
	p.lastDraw = time.Now()
	const width = 24
	filled := int(p.fraction() * width)
	fmt.Fprintf(p.w, "\r\033[K%s [%s%s] %3.0f%% %s", p.name, strings.Repeat("#", filled), strings.Repeat(".", width-filled), 100*p.fraction(), p.status())
	p.barShown = true
}

// line prints a plain progress line.
func (p *progress) line() {
	p.lastLine = time.Now()
	fmt.Fprintf(p.w, "%s: %.0f%%: %s; moving averages over the last %d requests; %d of %d clients finished\n",
		p.name, 100*p.fraction(), p.status(), min(p.ttft.n, len(p.ttft.window)), p.exited, p.clients)
}
