// Package xferbench is the `kvbridge bench transfer` benchmark: a nixlbench-like matrix of
// READ and WRITE transfers between this process and a peer process on the same machine
// (block sizes × batch sizes, descriptors in scattered order, SHM, TCP and UCX backends),
// with the ceilings measured in the same run — a single-thread memcpy of the same bytes for
// SHM (and UCX over shared memory) and a raw Go loopback TCP stream for TCP (and UCX over
// TCP) — so that results read as a ratio of the ceiling. The backends of one row are measured
// in interleaved rounds, and UCX rows also report their ratio to the TCP and SHM rows of the
// same run (the UCX transports are the environment's: UCX_TLS, UCX_NET_DEVICES).
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package xferbench

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os/exec"
	"slices"
	"strings"
	"time"

	"github.com/kvbridge/kvbridge/stats"
	"github.com/kvbridge/kvbridge/transfer"
)

// Options selects the matrix and how it runs.
type Options struct {
	Backends   []string      // "SHM", "TCP", "UCX" (default SHM and TCP; UCX needs -tags ucx)
	Ops        []transfer.Op // default READ and WRITE
	Blocks     []int64       // block sizes in bytes (default 4 KiB … 4 MiB in powers of 4)
	Batches    []int         // descriptors per request (default 1, 4, 16, 64, 256, 1024)
	Iters      int           // timed posts per round; 0 = automatic (by bytes moved)
	Rounds     int           // rounds per row, each preceded by a ceiling run; the best is kept (default 3)
	Warmup     int           // untimed posts per row (default 3)
	MaxBytes   int64         // largest request (block × batch); bigger rows are skipped (default 256 MiB)
	Workers    int           // SHM copy workers (0 = GOMAXPROCS)
	Streams    int           // TCP connections per peer (0 = default)
	UCXWorkers int           // UCX workers per agent, both sides (0 = default)
	Seed       uint64        // shuffling seed
	Notify     bool          // attach a notification to every post (as nixlbench does)
	Log        io.Writer     // progress lines (nil = none)
	// PeerCommand returns the command that runs the peer side (RunPeer) in another process,
	// with its stdin and stdout left for the benchmark to connect.
	PeerCommand func(ctx context.Context) *exec.Cmd
}

// DefaultBlocks returns the default block sizes.
func DefaultBlocks() []int64 {
	return []int64{4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20}
}

// DefaultBatches returns the default batch sizes.
func DefaultBatches() []int { return []int{1, 4, 16, 64, 256, 1024} }

// Row is one measured cell of the matrix.
type Row struct {
	Backend     string  `json:"backend"`
	Op          string  `json:"op"`
	BlockBytes  int64   `json:"block_bytes"`
	Batch       int     `json:"batch"`
	Iters       int     `json:"iters"`
	GBps        float64 `json:"gbps"`
	CeilingGBps float64 `json:"ceiling_gbps"`
	Ceiling     string  `json:"ceiling"`                // "memcpy" or "tcp_stream" (both over the row's own bytes)
	TCPHotGBps  float64 `json:"tcp_hot_gbps,omitempty"` // TCP rows: raw stream re-sending one hot block-sized buffer
	Ratio       float64 `json:"ratio"`
	PostAvgUs   float64 `json:"post_avg_us"`
	PostP99Us   float64 `json:"post_p99_us"`
	XferAvgUs   float64 `json:"xfer_avg_us"`
	XferP50Us   float64 `json:"xfer_p50_us"`
	XferP99Us   float64 `json:"xfer_p99_us"`
	Descs       int     `json:"descs"`
	MergedDescs int     `json:"merged_descs"`
	Fallback    string  `json:"fallback,omitempty"`
	VsTCP       float64 `json:"vs_tcp,omitempty"` // UCX rows: GB/s over the TCP backend's in the same run and row
	VsSHM       float64 `json:"vs_shm,omitempty"` // UCX rows: GB/s over the SHM backend's in the same run and row
}

// peerHello is the first line the benchmark writes to the peer's stdin.
type peerHello struct {
	ArenaBytes int64    `json:"arena_bytes"`
	Seed       uint64   `json:"seed"`
	Backends   []string `json:"backends"` // the backends the peer offers
	UCXWorkers int      `json:"ucx_workers"`
}

// peerReady is the peer's answer on stdout.
type peerReady struct {
	Metadata string `json:"metadata"` // base64
	Error    string `json:"error,omitempty"`
}

// withDefaults fills the zero fields.
func (o Options) withDefaults() (Options, error) {
	if len(o.Backends) == 0 {
		o.Backends = []string{"SHM", "TCP"}
	}
	for i, b := range o.Backends {
		o.Backends[i] = strings.ToUpper(b)
	}
	if _, err := transfer.ParseBackends(o.Backends); err != nil {
		return o, err
	}
	if len(o.Ops) == 0 {
		o.Ops = []transfer.Op{transfer.Read, transfer.Write}
	}
	if len(o.Blocks) == 0 {
		o.Blocks = DefaultBlocks()
	}
	if len(o.Batches) == 0 {
		o.Batches = DefaultBatches()
	}
	if o.Warmup <= 0 {
		o.Warmup = 3
	}
	if o.Rounds <= 0 {
		o.Rounds = 3
	}
	if o.MaxBytes <= 0 {
		o.MaxBytes = 256 << 20
	}
	if o.Seed == 0 {
		o.Seed = 1
	}
	if o.PeerCommand == nil {
		return o, errors.New("xferbench: PeerCommand is required")
	}
	for _, b := range o.Blocks {
		if b <= 0 || b%8 != 0 {
			return o, fmt.Errorf("xferbench: block size %d must be a positive multiple of 8", b)
		}
	}
	for _, n := range o.Batches {
		if n <= 0 {
			return o, fmt.Errorf("xferbench: batch %d must be positive", n)
		}
	}
	return o, nil
}

// logf writes a progress line.
func (o *Options) logf(format string, args ...any) {
	if o.Log != nil {
		fmt.Fprintf(o.Log, format+"\n", args...)
	}
}

// arenaBytes is the arena size both sides need: the largest request that is not skipped.
func (o *Options) arenaBytes() int64 {
	var m int64
	for _, b := range o.Blocks {
		for _, n := range o.Batches {
			if s := b * int64(n); s <= o.MaxBytes && s > m {
				m = s
			}
		}
	}
	return m
}

// Run measures the matrix and returns its rows (in backend, op, block, batch order).
func Run(ctx context.Context, opts Options) ([]Row, error) {
	o, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	size := o.arenaBytes()
	if size == 0 {
		return nil, fmt.Errorf("xferbench: every row exceeds --max-bytes %d", o.MaxBytes)
	}
	peer, err := startPeer(ctx, &o, size)
	if err != nil {
		return nil, err
	}
	defer peer.stop()

	agent, err := transfer.NewAgent("xferbench-initiator", transfer.Config{Workers: o.Workers, TCPStreams: o.Streams, Backends: o.Backends, UCXWorkers: o.UCXWorkers})
	if err != nil {
		return nil, err
	}
	defer agent.Close()
	local, err := transfer.NewArena("xferbench-local", size)
	if err != nil {
		return nil, err
	}
	defer local.Close()
	// mirror holds the peer's pattern locally: the memcpy ceiling copies from it, and READ
	// results are checked against it.
	mirror, err := transfer.NewArena("xferbench-mirror", size)
	if err != nil {
		return nil, err
	}
	defer mirror.Close()
	fillPattern(mirror.Bytes(), o.Seed)
	lreg, err := agent.Register(local, 0, size, 0)
	if err != nil {
		return nil, err
	}
	defer agent.Deregister(lreg)
	peerName, err := agent.LoadRemote(peer.meta)
	if err != nil {
		return nil, err
	}
	remoteRegion, err := firstRegion(agent, peerName)
	if err != nil {
		return nil, err
	}

	m := &matrix{o: &o, agent: agent, peerName: peerName, remoteRegion: remoteRegion, lreg: lreg,
		local: local, mirror: mirror, size: size, tcpCeil: map[int64]float64{}, rng: rand.New(rand.NewPCG(o.Seed, 7))}
	for _, block := range o.Blocks {
		if err := m.runBlock(ctx, block); err != nil {
			return m.rows, err
		}
	}
	// Report in backend, op, block, batch order.
	rank := func(r Row) [4]int {
		return [4]int{slices.Index(o.Backends, r.Backend), slices.IndexFunc(o.Ops, func(op transfer.Op) bool { return op.String() == r.Op }),
			slices.Index(o.Blocks, r.BlockBytes), slices.Index(o.Batches, r.Batch)}
	}
	slices.SortStableFunc(m.rows, func(a, b Row) int {
		ra, rb := rank(a), rank(b)
		return slices.Compare(ra[:], rb[:])
	})
	return m.rows, nil
}

// matrix is one Run's setup and results.
type matrix struct {
	o             *Options
	agent         *transfer.Agent
	peerName      string
	remoteRegion  uint32
	lreg          *transfer.Region
	local, mirror *transfer.Arena
	size          int64
	tcpCeil       map[int64]float64 // raw TCP stream ceiling by block size
	lanes         []string          // UCX lanes, once a UCX list is prepared
	rng           *rand.Rand
	rows          []Row
}

// runBlock measures the rows of one block size: every op and batch over every backend.
func (m *matrix) runBlock(ctx context.Context, block int64) error {
	o := m.o
	slots := int(m.size / block)
	ll, err := m.agent.PrepareLocal(transfer.BlockDescs(m.lreg.ID(), 0, block, slots))
	if err != nil {
		return err
	}
	rls := make([]*transfer.PreparedList, 0, len(o.Backends))
	defer func() {
		ll.Release()
		for _, rl := range rls {
			rl.Release()
		}
	}()
	for _, be := range o.Backends {
		rl, err := m.agent.PrepareRemote(ctx, m.peerName, transfer.BlockDescs(m.remoteRegion, 0, block, slots), &transfer.PrepareOptions{Backends: []string{be}})
		if err != nil {
			return fmt.Errorf("xferbench: backend %s: %w", be, err)
		}
		rls = append(rls, rl)
		if be == "UCX" && m.lanes == nil {
			info, _ := m.agent.Peer(m.peerName)
			m.lanes = info.UCXLanes
			o.logf("UCX lanes: %s", strings.Join(m.lanes, "; "))
		}
	}
	if slices.Contains(o.Backends, "TCP") {
		if _, ok := m.tcpCeil[block]; !ok {
			g, err := tcpStreamGBps(ctx, block)
			if err != nil {
				return err
			}
			m.tcpCeil[block] = g
			o.logf("raw loopback TCP stream of one hot %s buffer: %.2f GB/s", sizeName(block), g)
		}
	}
	for _, op := range o.Ops {
		for _, batch := range o.Batches {
			if block*int64(batch) > o.MaxBytes {
				continue
			}
			if err := m.runRow(ctx, op, block, slots, batch, ll, rls); err != nil {
				return err
			}
		}
	}
	return nil
}

// runRow measures one row (op, block, batch) over the backends' prepared lists rls.
func (m *matrix) runRow(ctx context.Context, op transfer.Op, block int64, slots, batch int, ll *transfer.PreparedList, rls []*transfer.PreparedList) error {
	o := m.o
	lidx := m.rng.Perm(slots)[:batch]
	ridx := m.rng.Perm(slots)[:batch]
	memcpyCeil := func() float64 {
		return memcpyGBps(m.local.Bytes(), m.mirror.Bytes(), block, lidx, ridx, o.iters(block*int64(batch), true))
	}
	tcpCeilFn := func() float64 {
		g, err := tcpSameBytesGBps(ctx, m.local.Bytes(), m.mirror.Bytes(), block, lidx, ridx, o.tcpIters(block*int64(batch)))
		if err != nil {
			o.logf("tcp ceiling: %v", err)
		}
		return g
	}
	cells := make([]*cell, 0, len(rls))
	defer func() {
		for _, c := range cells {
			c.req.Release()
		}
	}()
	for i, rl := range rls {
		c := &cell{backend: o.Backends[i], rl: rl, ceil: memcpyCeil, ceiling: "memcpy"}
		if c.backend == "TCP" || (c.backend == "UCX" && ucxOverTCP(m.lanes)) {
			c.ceil, c.ceiling = tcpCeilFn, "tcp_stream"
		}
		if err := c.prepare(ctx, o, m.agent, op, ll, lidx, ridx, block, m.local.Bytes(), m.mirror.Bytes()); err != nil {
			return err
		}
		cells = append(cells, c)
	}
	// Rounds interleave the backends (each round after its own ceiling run), so
	// that every backend meets the same machine and ratios between them mean
	// something on a shared, noisy host.
	for range o.Rounds {
		for _, c := range cells {
			if err := c.round(ctx); err != nil {
				return err
			}
		}
	}
	byBackend := map[string]float64{}
	for _, c := range cells {
		byBackend[c.backend] = c.best
	}
	for _, c := range cells {
		row := c.row(op, block, len(lidx))
		if row.Backend == "TCP" {
			row.TCPHotGBps = m.tcpCeil[block]
		}
		if row.Backend == "UCX" {
			if g := byBackend["TCP"]; g > 0 {
				row.VsTCP = row.GBps / g
			}
			if g := byBackend["SHM"]; g > 0 {
				row.VsSHM = row.GBps / g
			}
		}
		o.logf("%-3s %-5s %7s x %-4d %7.2f GB/s  ceiling %6.2f  ratio %.2f", row.Backend, row.Op, sizeName(block), batch, row.GBps, row.CeilingGBps, row.Ratio)
		m.rows = append(m.rows, row)
	}
	return nil
}

// ucxOverTCP reports whether UCX moves data over TCP (then the TCP stream is its ceiling).
func ucxOverTCP(lanes []string) bool {
	for _, l := range lanes {
		if strings.HasPrefix(l, "tcp/") {
			return true
		}
	}
	return false
}

// firstRegion returns the id of the peer's (only) region: the benchmark target registers
// its whole arena as region 1.
func firstRegion(a *transfer.Agent, peer string) (uint32, error) {
	info, ok := a.Peer(peer)
	if !ok || info.Regions == 0 {
		return 0, fmt.Errorf("xferbench: peer %q published no region", peer)
	}
	return 1, nil
}

// iters returns the timed iterations for a request of n bytes.
func (o *Options) iters(n int64, memcpy bool) int {
	if o.Iters > 0 && !memcpy {
		return o.Iters
	}
	target := int64(128 << 20)
	if !memcpy {
		target = 64 << 20
	}
	it := target / n
	return int(min(max(it, 10), 1000))
}

// tcpIters returns the repetitions of the TCP ceiling for a request of n bytes (~32 MiB).
func (o *Options) tcpIters(n int64) int { return int(min(max((32<<20)/n, 2), 500)) }

// cell is one backend's measurement of one row of the matrix.
type cell struct {
	backend string
	rl      *transfer.PreparedList
	ceil    func() float64
	ceiling string

	req      *transfer.Request
	notif    []byte
	n        int
	posts    []float64
	xfers    []float64
	best     float64
	bestCeil float64
}

// prepare makes the cell's request, runs the warmup posts and checks READ data.
func (c *cell) prepare(ctx context.Context, o *Options, a *transfer.Agent, op transfer.Op, ll *transfer.PreparedList, lidx, ridx []int,
	block int64, local, mirror []byte) error {
	req, err := a.MakeRequest(op, ll, lidx, c.rl, ridx, &transfer.RequestOptions{Timeout: time.Minute})
	if err != nil {
		return err
	}
	c.req = req
	if o.Notify {
		c.notif = []byte("0xBEEF")
	}
	if op == transfer.Write {
		// Write the peer's own pattern back, so its arena keeps matching mirror.
		for k, li := range lidx {
			copy(local[int64(li)*block:int64(li+1)*block], mirror[int64(ridx[k])*block:int64(ridx[k]+1)*block])
		}
	} else {
		clear(local) // the check below must see this backend's bytes
	}
	for i := 0; i < o.Warmup; i++ {
		if _, err := c.post(ctx); err != nil {
			return err
		}
	}
	if op == transfer.Read {
		for k, li := range lidx {
			l := local[int64(li)*block : int64(li+1)*block]
			m := mirror[int64(ridx[k])*block : int64(ridx[k]+1)*block]
			if string(l) != string(m) {
				return fmt.Errorf("xferbench: %s READ %s x %d: block %d differs from the peer's pattern", c.backend, sizeName(block), len(lidx), k)
			}
		}
	}
	c.n = o.iters(req.Bytes(), false)
	return nil
}

// post posts the request once and waits for it; it returns the time spent in Post.
func (c *cell) post(ctx context.Context) (time.Duration, error) {
	t0 := time.Now()
	if err := c.req.Post(ctx, c.notif); err != nil {
		return 0, err
	}
	d := time.Since(t0)
	return d, c.req.Wait(ctx)
}

// round runs the ceiling once, then the cell's timed posts.
func (c *cell) round(ctx context.Context) error {
	c.bestCeil = max(c.bestCeil, c.ceil())
	start := time.Now()
	for range c.n {
		pd, err := c.post(ctx)
		if err != nil {
			return err
		}
		c.posts = append(c.posts, us(pd))
		c.xfers = append(c.xfers, us(c.req.Telemetry().TransferDuration))
	}
	c.best = max(c.best, float64(c.req.Bytes())*float64(c.n)/time.Since(start).Seconds()/1e9)
	return nil
}

// row reports the cell.
func (c *cell) row(op transfer.Op, block int64, batch int) Row {
	before, after := c.req.Descs()
	r := Row{
		Backend: c.rl.Backend().String(), Fallback: c.rl.FallbackReason(),
		Op: op.String(), BlockBytes: block, Batch: batch, Iters: len(c.posts),
		GBps: c.best, CeilingGBps: c.bestCeil, Ceiling: c.ceiling,
		PostAvgUs: stats.Mean(c.posts), PostP99Us: stats.NearestRank(c.posts, 0.99),
		XferAvgUs: stats.Mean(c.xfers), XferP50Us: stats.NearestRank(c.xfers, 0.50), XferP99Us: stats.NearestRank(c.xfers, 0.99),
		Descs: before, MergedDescs: after,
	}
	if r.CeilingGBps > 0 {
		r.Ratio = r.GBps / r.CeilingGBps
	}
	return r
}

// us converts a duration to microseconds.
func us(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }

// sizeName formats a byte count as 4K, 64K, 1M.
func sizeName(n int64) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%dM", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%dK", n>>10)
	}
	return fmt.Sprintf("%d", n)
}

// peerProc is the running peer process.
type peerProc struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	meta  []byte
}

// startPeer starts the peer, sends it the arena size and reads its metadata.
func startPeer(ctx context.Context, o *Options, size int64) (*peerProc, error) {
	cmd := o.PeerCommand(ctx)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("xferbench: starting the peer: %w", err)
	}
	p := &peerProc{cmd: cmd, stdin: stdin}
	hello, _ := json.Marshal(peerHello{ArenaBytes: size, Seed: o.Seed, Backends: o.Backends, UCXWorkers: o.UCXWorkers})
	if _, err := fmt.Fprintf(stdin, "%s\n", hello); err != nil {
		p.stop()
		return nil, fmt.Errorf("xferbench: peer: %w", err)
	}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		p.stop()
		return nil, fmt.Errorf("xferbench: peer did not answer: %w", err)
	}
	var ready peerReady
	if err := json.Unmarshal([]byte(line), &ready); err != nil {
		p.stop()
		return nil, fmt.Errorf("xferbench: peer answer %q: %w", line, err)
	}
	if ready.Error != "" {
		p.stop()
		return nil, fmt.Errorf("xferbench: peer: %s", ready.Error)
	}
	p.meta, err = base64.StdEncoding.DecodeString(ready.Metadata)
	if err != nil {
		p.stop()
		return nil, err
	}
	return p, nil
}

// stop closes the peer's stdin (it exits) and waits for it.
func (p *peerProc) stop() {
	p.stdin.Close()
	done := make(chan struct{})
	go func() {
		_ = p.cmd.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-done
	}
}

// RunPeer is the peer side: it reads the hello line from in, creates the target agent and
// arena (filled with the benchmark pattern, registered read-write), writes its metadata to
// out and serves until in reaches EOF.
func RunPeer(ctx context.Context, in io.Reader, out io.Writer) error {
	br := bufio.NewReader(in)
	line, err := br.ReadString('\n')
	if err != nil {
		return fmt.Errorf("xferbench peer: reading hello: %w", err)
	}
	var h peerHello
	if err := json.Unmarshal([]byte(line), &h); err != nil {
		return fmt.Errorf("xferbench peer: hello: %w", err)
	}
	fail := func(err error) error {
		b, _ := json.Marshal(peerReady{Error: err.Error()})
		fmt.Fprintf(out, "%s\n", b)
		return err
	}
	a, err := transfer.NewAgent("xferbench-target", transfer.Config{Backends: h.Backends, UCXWorkers: h.UCXWorkers})
	if err != nil {
		return fail(err)
	}
	defer a.Close()
	ar, err := transfer.NewArena("xferbench-target", h.ArenaBytes)
	if err != nil {
		return fail(err)
	}
	defer ar.Close()
	fillPattern(ar.Bytes(), h.Seed)
	r, err := a.Register(ar, 0, h.ArenaBytes, transfer.PermReadWrite)
	if err != nil {
		return fail(err)
	}
	defer a.Deregister(r)
	b, _ := json.Marshal(peerReady{Metadata: base64.StdEncoding.EncodeToString(a.LocalMetadata())})
	if _, err := fmt.Fprintf(out, "%s\n", b); err != nil {
		return err
	}
	// Serve until the benchmark closes stdin (or ctx ends); drain notifications meanwhile.
	eof := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, br)
		close(eof)
	}()
	for {
		select {
		case <-eof:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		case <-a.Notifications():
		}
	}
}
