package pdbench

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kvbridge/kvbridge/netns"
	"github.com/kvbridge/kvbridge/proxy"
)

// hostStackConfig describes the engines a hosts benchmark starts as processes.
type hostStackConfig struct {
	command     []string // runs kvbridge (default this executable)
	model       string
	blockSize   int
	numBlocks   int
	maxModelLen int
	log         *slog.Logger
	// kv is added to P's and D's --kv-transfer-config (nil: the NixlConnector); transferMode is
	// the proxy's.
	kv           map[string]any
	transferMode proxy.TransferMode
	// prefillTP and decodeTP are P's and D's --tensor-parallel-size (the single engine's is 1).
	prefillTP, decodeTP int
}

// hostStack is a single engine, P and D as kvbridge processes on hosts of their own, and the
// one-way proxy in this process, listening on, and dialling from, a client host: every hop of a
// request crosses a network stack.
type hostStack struct {
	net             *netns.Network
	clientH, pH, dH *netns.Host
	single, p, d    *engineProcess
	proxy           *proxy.OneWay
	tracer          *tracer
	proxyURL        string
	srv             *http.Server
	served          chan error
	hc              *http.Client
	last            [2]metricSums // P's and D's transfer sums at the previous takeTransfers
	stream          *tcpStream
	closeOnce       sync.Once
	closeErr        error
}

// enginePort and sideChannelPort are every engine host's ports, as in the seed guide.
const (
	enginePort      = 8000
	sideChannelPort = 5600
	// transferStreams is the number of TCP connections the transfer engine opens to a peer
	// (transfer.Config.TCPStreams' default).
	transferStreams = 4
	// engineStartTimeout bounds an engine's start (a model opened from disk may take a while).
	engineStartTimeout = 2 * time.Minute
)

// startHostStack makes the network, starts the engines and the proxy. On error everything
// started is stopped.
func startHostStack(ctx context.Context, cfg hostStackConfig) (_ *hostStack, err error) {
	if len(cfg.command) == 0 {
		exe, err := os.Executable()
		if err != nil {
			return nil, fmt.Errorf("pdbench: %w", err)
		}
		cfg.command = []string{exe}
	}
	n, err := netns.New(ctx, netns.Config{})
	if err != nil {
		return nil, fmt.Errorf("pdbench: --hosts: %w", err)
	}
	s := &hostStack{net: n, served: make(chan error, 1)}
	defer func() {
		if err != nil {
			s.Close()
		}
	}()
	hosts := make(map[string]*netns.Host)
	for _, name := range []string{"client", "single", "p", "d"} {
		if hosts[name], err = n.AddHost(ctx, name); err != nil {
			return nil, fmt.Errorf("pdbench: %w", err)
		}
	}
	s.clientH, s.pH, s.dH = hosts["client"], hosts["p"], hosts["d"]
	s.hc = &http.Client{Transport: s.clientH.Transport()}
	args := func(role string) []string {
		a := []string{"serve", cfg.model, "--port", strconv.Itoa(enginePort), "--block-size", strconv.Itoa(cfg.blockSize),
			"--num-gpu-blocks-override", strconv.Itoa(cfg.numBlocks), "--max-model-len", strconv.Itoa(cfg.maxModelLen),
			"--no-enable-prefix-caching"}
		if tp := map[string]int{"kv_producer": cfg.prefillTP, "kv_consumer": cfg.decodeTP}[role]; tp > 1 {
			a = append(a, "--tensor-parallel-size", strconv.Itoa(tp))
		}
		if role != "" {
			m := map[string]any{"kv_connector": "NixlConnector"}
			maps.Copy(m, cfg.kv)
			extra := map[string]any{"backends": []string{"TCP"}}
			if e, ok := cfg.kv["kv_connector_extra_config"].(map[string]any); ok {
				maps.Copy(extra, e)
			}
			m["kv_role"], m["kv_connector_extra_config"] = role, extra
			kv, _ := json.Marshal(m)
			a = append(a, "--kv-transfer-config", string(kv))
		}
		return a
	}
	for _, e := range []struct {
		dst  **engineProcess
		host *netns.Host
		role string
	}{{&s.single, hosts["single"], ""}, {&s.p, s.pH, "kv_producer"}, {&s.d, s.dH, "kv_consumer"}} {
		if *e.dst, err = startEngineProcess(ctx, e.host, cfg.command, args(e.role)); err != nil {
			return nil, err
		}
	}
	for _, e := range []*engineProcess{s.single, s.p, s.d} {
		if err := e.waitHealthy(ctx, s.hc, engineStartTimeout); err != nil {
			return nil, err
		}
	}
	pi, err := proxy.NewInstance(s.pH.Addr.String(), enginePort)
	if err != nil {
		return nil, fmt.Errorf("pdbench: %w", err)
	}
	di, err := proxy.NewInstance(s.dH.Addr.String(), enginePort)
	if err != nil {
		return nil, fmt.Errorf("pdbench: %w", err)
	}
	s.tracer = newTracer(s.clientH.Transport())
	s.tracer.setPrefill(pi.String())
	if s.proxy, err = proxy.NewOneWay(proxy.Config{Prefill: []proxy.Instance{pi}, Decode: []proxy.Instance{di}, Transport: s.tracer, Logger: cfg.log, TransferMode: cfg.transferMode}); err != nil {
		return nil, fmt.Errorf("pdbench: %w", err)
	}
	ln, err := s.clientH.Listen("tcp4", netip.AddrPortFrom(s.clientH.Addr, 0).String())
	if err != nil {
		return nil, fmt.Errorf("pdbench: proxy listener: %w", err)
	}
	s.proxyURL = "http://" + ln.Addr().String()
	s.srv = &http.Server{Handler: s.proxy, ReadHeaderTimeout: 30 * time.Second}
	go func() { s.served <- s.srv.Serve(ln) }()
	if s.stream, err = newTCPStream(ctx, s.pH, s.dH, transferStreams); err != nil {
		return nil, err
	}
	return s, nil
}

func (s *hostStack) client() *http.Client { return s.hc }

func (s *hostStack) urls() (single, proxy string) { return s.single.url, s.proxyURL }

func (s *hostStack) legs(id string) (legTimes, bool) { return s.tracer.take(id) }

// engineCPU returns the CPU time each engine process used so far (engineProcess.cpu).
func (s *hostStack) engineCPU() (single, p, d time.Duration, ok bool) {
	single, err1 := s.single.cpu()
	p, err2 := s.p.cpu()
	d, err3 := s.d.cpu()
	return single, p, d, err1 == nil && err2 == nil && err3 == nil
}

// engineTTFT reads the engines' vllm:time_to_first_token_seconds sums over HTTP.
func (s *hostStack) engineTTFT(ctx context.Context) (single, p, d time.Duration, err error) {
	var out [3]time.Duration
	for i, e := range []*engineProcess{s.single, s.p, s.d} {
		m, err := scrape(ctx, s.hc, e.url)
		if err != nil {
			return 0, 0, 0, err
		}
		out[i] = seconds(m["vllm:time_to_first_token_seconds_sum"])
	}
	return out[0], out[1], out[2], nil
}

// dStepTokens reads D's vllm:iteration_tokens_total sum over HTTP.
func (s *hostStack) dStepTokens(ctx context.Context) (int64, error) {
	m, err := scrape(ctx, s.hc, s.d.url)
	return int64(m["vllm:iteration_tokens_total_sum"]), err
}

// takeTransfers reads D's transfer histograms and counters over HTTP and returns what they
// gained since the previous call.
// settle polls P's vllm:kv_cache_usage_perc until P holds no block (every request of the
// benchmark has ended there; finished blocks stay cached but unused).
func (s *hostStack) settle(ctx context.Context) error {
	return pollUntil(ctx, "P to let go of the request's blocks", func() (bool, error) {
		m, err := scrape(ctx, s.hc, s.p.url)
		return err == nil && m["vllm:kv_cache_usage_perc"] == 0, err
	})
}

func (s *hostStack) takeTransfers(ctx context.Context) (transfers, error) {
	var sum transfers
	for i, e := range []*engineProcess{s.p, s.d} { // D reads (pull), P writes (push)
		m, err := scrape(ctx, s.hc, e.url)
		if err != nil {
			return transfers{}, err
		}
		prev := s.last[i]
		s.last[i] = m
		sum.n += int64(m["vllm:nixl_xfer_time_seconds_count"] - prev["vllm:nixl_xfer_time_seconds_count"])
		sum.failed += int64(m["vllm:nixl_num_failed_transfers_total"] - prev["vllm:nixl_num_failed_transfers_total"])
		sum.dur += seconds(m["vllm:nixl_xfer_time_seconds_sum"] - prev["vllm:nixl_xfer_time_seconds_sum"])
		sum.bytes += int64(m["vllm:nixl_bytes_transferred_sum"] - prev["vllm:nixl_bytes_transferred_sum"])
	}
	return sum, nil
}

// ceiling is a raw TCP stream of n bytes from P's host to D's, in GB/s: the median of three
// rounds over one warm connection, and over as many as the transfer engine uses; the better
// of the two is the ceiling.
func (s *hostStack) ceiling(ctx context.Context, n int64) (ceilings, error) {
	one, err := s.stream.gbps(ctx, n, 1, 3)
	if err != nil {
		return ceilings{}, err
	}
	many, err := s.stream.gbps(ctx, n, transferStreams, 3)
	if err != nil {
		return ceilings{}, err
	}
	return ceilings{best: max(one, many), oneConn: one, manyConns: many}, nil
}

// Close stops the proxy and the engines and removes the hosts. It is idempotent.
func (s *hostStack) Close() error {
	s.closeOnce.Do(func() {
		var errs []error
		if s.srv != nil {
			errs = append(errs, stopServer(s.srv, s.served))
		}
		if s.proxy != nil {
			errs = append(errs, s.proxy.Close())
		}
		if s.stream != nil {
			errs = append(errs, s.stream.Close())
		}
		for _, e := range []*engineProcess{s.d, s.p, s.single} {
			if e != nil {
				e.stop()
			}
		}
		if s.hc != nil {
			s.hc.CloseIdleConnections()
		}
		errs = append(errs, s.net.Close())
		s.closeErr = errors.Join(errs...)
	})
	return s.closeErr
}

// engineProcess is `kvbridge serve` running on a host.
type engineProcess struct {
	host *netns.Host
	url  string
	cmd  *exec.Cmd
	done chan struct{}
	err  error // the process's exit, once done is closed

	mu     sync.Mutex
	stderr []byte // the last stderrKeep bytes of its log
}

const stderrKeep = 16 << 10

// cpu returns the CPU time e's process has used so far: the sum over its threads of the
// scheduler's on-CPU time (/proc/PID/task/*/schedstat, nanoseconds; /proc/PID/stat counts in
// clock ticks of 10 ms, too coarse for one request).
func (e *engineProcess) cpu() (time.Duration, error) {
	if e == nil || e.cmd.Process == nil {
		return 0, errors.New("pdbench: no engine process")
	}
	return taskCPU(e.cmd.Process.Pid)
}

// startEngineProcess starts command + args on h, its log kept for error messages.
func startEngineProcess(ctx context.Context, h *netns.Host, command, args []string) (*engineProcess, error) {
	e := &engineProcess{host: h, url: "http://" + net.JoinHostPort(h.Addr.String(), strconv.Itoa(enginePort)), done: make(chan struct{})}
	e.cmd = h.Command(context.WithoutCancel(ctx), command[0], append(append([]string(nil), command[1:]...), args...)...)
	e.cmd.Env = append(os.Environ(),
		"VLLM_NIXL_SIDE_CHANNEL_HOST="+h.Addr.String(),
		"VLLM_NIXL_SIDE_CHANNEL_PORT="+strconv.Itoa(sideChannelPort),
		"VLLM_LOG_STATS_INTERVAL=1000000") // the benchmark reads the metrics itself
	pipe, err := e.cmd.StderrPipe()
	if err != nil {
		return nil, fmt.Errorf("pdbench: %w", err)
	}
	if err := e.cmd.Start(); err != nil {
		return nil, fmt.Errorf("pdbench: start %s on host %s: %w", command[0], h.Name, err)
	}
	go func() {
		sc := bufio.NewScanner(pipe)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			e.mu.Lock()
			e.stderr = append(e.stderr, sc.Bytes()...)
			e.stderr = append(e.stderr, '\n')
			if len(e.stderr) > stderrKeep {
				e.stderr = e.stderr[len(e.stderr)-stderrKeep:]
			}
			e.mu.Unlock()
		}
		e.err = e.cmd.Wait()
		close(e.done)
	}()
	return e, nil
}

// log returns the tail of the process's log.
func (e *engineProcess) log() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return string(e.stderr)
}

// waitHealthy polls /health until it answers 200, the process exits, or within passes.
func (e *engineProcess) waitHealthy(ctx context.Context, hc *http.Client, within time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, e.url+"/health", nil)
		if resp, err := hc.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-e.done:
			return fmt.Errorf("pdbench: the engine on host %s exited: %v\n%s", e.host.Name, e.err, e.log())
		case <-ctx.Done():
			return fmt.Errorf("pdbench: the engine on host %s was not healthy within %s: %w\n%s", e.host.Name, within, ctx.Err(), e.log())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// stop ends the process: SIGTERM, then SIGKILL after 10 s.
func (e *engineProcess) stop() {
	_ = e.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-e.done:
	case <-time.After(10 * time.Second):
		_ = e.cmd.Process.Kill()
		<-e.done
	}
}

// metricSums maps a Prometheus sample name (labels dropped) to the sum of its samples.
type metricSums map[string]float64

// scrape reads url's /metrics in Prometheus' text format.
func scrape(ctx context.Context, hc *http.Client, url string) (metricSums, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url+"/metrics", nil)
	if err != nil {
		return nil, fmt.Errorf("pdbench: %w", err)
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("pdbench: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("pdbench: GET %s/metrics answered %d", url, resp.StatusCode)
	}
	m := metricSums{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		name, rest := line, ""
		if i := strings.IndexAny(line, "{ "); i >= 0 {
			name, rest = line[:i], line[i:]
		}
		if strings.HasPrefix(rest, "{") {
			_, rest, _ = strings.Cut(rest, "}")
		}
		f := strings.Fields(rest)
		if len(f) == 0 {
			continue
		}
		if v, err := strconv.ParseFloat(f[0], 64); err == nil {
			m[name] += v
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("pdbench: reading %s/metrics: %w", url, err)
	}
	return m, nil
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
