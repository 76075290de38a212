package metrics

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// TransferSample is one completed KV READ (or WRITE) as the transfer telemetry reports it.
type TransferSample struct {
	Duration     time.Duration // transfer duration (NIXL xferDuration)
	PostDuration time.Duration // time to post the request (NIXL postDuration)
	Bytes        int64         // bytes moved
	Descriptors  int           // descriptors in the transfer
}

// nixlVecs holds the labelled NIXL collectors of a Registry (docs/architecture.md, wire contract
// item 42).
type nixlVecs struct {
	xferTime, postTime, bytes, descriptors           *prometheus.HistogramVec
	failedTransfers, failedNotifications, expiredReq *prometheus.CounterVec
	notificationsAfterExpiry                         *prometheus.CounterVec
	holdsExpired                                     *prometheus.CounterVec
}

func newNixlVecs(labels []string) nixlVecs {
	hist := func(name, help string, buckets []float64) *prometheus.HistogramVec {
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: name, Help: help, Buckets: buckets}, labels)
	}
	counter := func(name, help string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, labels)
	}
	return nixlVecs{
		xferTime: hist("vllm:nixl_xfer_time_seconds",
			"Histogram of transfer duration for NIXL KV Cache transfers.", NixlXferTimeBuckets()),
		postTime: hist("vllm:nixl_post_time_seconds",
			"Histogram of transfer post time for NIXL KV Cache transfers.", NixlPostTimeBuckets()),
		bytes: hist("vllm:nixl_bytes_transferred",
			"Number of bytes transferred per NIXL KV Cache transfers.", NixlBytesBuckets()),
		descriptors: hist("vllm:nixl_num_descriptors",
			"Number of descriptors per NIXL KV Cache transfers.", NixlDescriptorBuckets()),
		failedTransfers: counter("vllm:nixl_num_failed_transfers_total",
			"Number of failed NIXL KV Cache transfers."),
		failedNotifications: counter("vllm:nixl_num_failed_notifications_total",
			"Number of failed NIXL KV Cache notifications."),
		expiredReq: counter("vllm:nixl_num_kv_expired_reqs_total",
			"Number of requests that had their KV expire."),
		notificationsAfterExpiry: counter("vllm:nixl_num_notifications_after_expiry_total",
			"Number of NIXL notifications that arrived after the request's KV lease expired."),
		holdsExpired: counter("kvbridge:decoder_holds_expired_total",
			"Bidirectional decoder holds (a turn's KV kept for the next turn's prefiller) that reached decoder_kv_blocks_ttl unclaimed."),
	}
}

func (v nixlVecs) register(r *prometheus.Registry) {
	r.MustRegister(v.xferTime, v.postTime, v.bytes, v.descriptors,
		v.failedTransfers, v.failedNotifications, v.expiredReq, v.notificationsAfterExpiry, v.holdsExpired)
}

func (v nixlVecs) forEngine(modelName, engine string) *NixlMetrics {
	return &NixlMetrics{
		xferTime:                 v.xferTime.WithLabelValues(modelName, engine),
		postTime:                 v.postTime.WithLabelValues(modelName, engine),
		bytes:                    v.bytes.WithLabelValues(modelName, engine),
		descriptors:              v.descriptors.WithLabelValues(modelName, engine),
		failedTransfers:          v.failedTransfers.WithLabelValues(modelName, engine),
		failedNotifications:      v.failedNotifications.WithLabelValues(modelName, engine),
		expiredReq:               v.expiredReq.WithLabelValues(modelName, engine),
		notificationsAfterExpiry: v.notificationsAfterExpiry.WithLabelValues(modelName, engine),
		holdsExpired:             v.holdsExpired.WithLabelValues(modelName, engine),
	}
}

// NixlMetrics records the NIXL connector's transfer statistics of one engine: the Prometheus
// series of docs/architecture.md's wire contract item 42 and the samples of the current logging
// interval (for KVTransferLogLine).
// Safe for concurrent use.
type NixlMetrics struct {
	xferTime, postTime, bytes, descriptors prometheus.Observer
	failedTransfers, failedNotifications   prometheus.Counter
	expiredReq, notificationsAfterExpiry   prometheus.Counter
	holdsExpired                           prometheus.Counter

	mu       sync.Mutex
	interval TransferInterval
}

// ObserveTransfer records one completed transfer.
func (n *NixlMetrics) ObserveTransfer(s TransferSample) {
	n.xferTime.Observe(s.Duration.Seconds())
	n.postTime.Observe(s.PostDuration.Seconds())
	n.bytes.Observe(float64(s.Bytes))
	n.descriptors.Observe(float64(s.Descriptors))
	n.mu.Lock()
	n.interval.Transfers = append(n.interval.Transfers, s)
	n.mu.Unlock()
}

// CountFailedTransfer counts a failed transfer or a failed handshake.
func (n *NixlMetrics) CountFailedTransfer() {
	n.failedTransfers.Inc()
	n.mu.Lock()
	n.interval.FailedTransfers++
	n.mu.Unlock()
}

// CountFailedNotification counts a notification that could not be sent. It counts in both
// vllm:nixl_num_failed_notifications_total and vllm:nixl_num_failed_transfers_total, which the
// seed guide defines as "failed NIXL transfers or notifications".
func (n *NixlMetrics) CountFailedNotification() {
	n.failedNotifications.Inc()
	n.failedTransfers.Inc()
	n.mu.Lock()
	n.interval.FailedNotifications++
	n.mu.Unlock()
}

// CountExpiredRequest counts a request whose KV lease expired (P) or whose bidirectional read
// was declined as expired (P on turn 2+). A decoder's hold that expires unclaimed is not one:
// see CountDecoderHoldExpired.
func (n *NixlMetrics) CountExpiredRequest() {
	n.expiredReq.Inc()
	n.mu.Lock()
	n.interval.ExpiredRequests++
	n.mu.Unlock()
}

// CountDecoderHoldExpired counts a bidirectional decoder's hold (the blocks of a turn kept for
// the next turn's prefiller) that reached decoder_kv_blocks_ttl without being pulled
// (kvbridge:decoder_holds_expired_total). That is a cache entry aging out, not a failure.
func (n *NixlMetrics) CountDecoderHoldExpired() { n.holdsExpired.Inc() }

// CountNotificationAfterExpiry counts a read notification that arrived after the blocks it
// refers to were released by lease expiry.
func (n *NixlMetrics) CountNotificationAfterExpiry() { n.notificationsAfterExpiry.Inc() }

// TakeInterval returns the samples recorded since the previous call and starts a new interval.
func (n *NixlMetrics) TakeInterval() TransferInterval {
	n.mu.Lock()
	defer n.mu.Unlock()
	iv := n.interval
	n.interval = TransferInterval{}
	return iv
}

// LogEvery writes the "KV Transfer metrics" line at INFO every interval (vLLM:
// VLLM_LOG_STATS_INTERVAL, 10 s) when the interval has data, until ctx is done. It blocks; the
// caller owns the goroutine it runs in.
func (n *NixlMetrics) LogEvery(ctx context.Context, log *slog.Logger, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if iv := n.TakeInterval(); !iv.Empty() {
				log.Info(KVTransferLogLine(iv))
			}
		}
	}
}
