package metrics

import (
	"math"
	"strconv"
	"strings"

	"github.com/kvbridge/kvbridge/stats"
)

// TransferInterval holds one logging interval's transfer statistics (vLLM's
// NixlKVConnectorStats.data accumulated over VLLM_LOG_STATS_INTERVAL).
type TransferInterval struct {
	Transfers           []TransferSample // completed transfers
	FailedTransfers     int              // failed transfers and failed handshakes
	FailedNotifications int              // notifications that could not be sent
	ExpiredRequests     int              // lease expiries and declined expired reads
}

// Empty reports whether the interval recorded nothing at all (then no log line is written).
func (iv TransferInterval) Empty() bool {
	return len(iv.Transfers) == 0 && iv.FailedTransfers == 0 && iv.FailedNotifications == 0 &&
		iv.ExpiredRequests == 0
}

// KVTransferLogLine formats the interval as vLLM's log line (docs/architecture.md, wire contract
// item 41; README.md, "Metrics"), with the two
// recommended trailing keys:
//
//	KV Transfer metrics: Num successful transfers=3, Avg xfer time (ms)=2.0, P90 xfer time (ms)=2.8,
//	Avg post time (ms)=…, P90 post time (ms)=…, Avg MB per transfer=…, Throughput (MB/s)=…,
//	Avg number of descriptors=…, Num failed transfers=…, Num KV expired reqs=…
//
// Values are rounded like Python's round() (3 decimals; descriptors 1) and printed like
// Python's str(float). P90 is numpy's default (linear interpolation) percentile. With no
// successful transfer every transfer value is 0. Num failed transfers counts failed transfers,
// handshakes and notifications.
func KVTransferLogLine(iv TransferInterval) string {
	var b strings.Builder
	b.WriteString("KV Transfer metrics: ")
	put := func(key, val string) {
		b.WriteString(key)
		b.WriteByte('=')
		b.WriteString(val)
		b.WriteString(", ")
	}
	n := len(iv.Transfers)
	put("Num successful transfers", strconv.Itoa(n))
	if n == 0 {
		for _, k := range []string{"Avg xfer time (ms)", "P90 xfer time (ms)", "Avg post time (ms)",
			"P90 post time (ms)", "Avg MB per transfer", "Throughput (MB/s)", "Avg number of descriptors"} {
			put(k, "0")
		}
	} else {
		xfer := make([]float64, n)
		post := make([]float64, n)
		mb := make([]float64, n)
		descs := make([]float64, n)
		for i, s := range iv.Transfers {
			xfer[i] = s.Duration.Seconds()
			post[i] = s.PostDuration.Seconds()
			mb[i] = float64(s.Bytes) / (1 << 20)
			descs[i] = float64(uint32(s.Descriptors))
		}
		totalMB := pairwiseSum(mb)
		totalTime := pairwiseSum(xfer)
		put("Avg xfer time (ms)", pyRound(pairwiseSum(xfer)/float64(n)*1e3, 3))
		put("P90 xfer time (ms)", pyRound(stats.Quantile(xfer, 0.9)*1e3, 3))
		put("Avg post time (ms)", pyRound(pairwiseSum(post)/float64(n)*1e3, 3))
		put("P90 post time (ms)", pyRound(stats.Quantile(post, 0.9)*1e3, 3))
		put("Avg MB per transfer", pyRound(totalMB/float64(n), 3))
		put("Throughput (MB/s)", pyRound(totalMB/totalTime, 3))
		put("Avg number of descriptors", pyRound(pairwiseSum(descs)/float64(n), 1))
	}
	put("Num failed transfers", strconv.Itoa(iv.FailedTransfers+iv.FailedNotifications))
	b.WriteString("Num KV expired reqs=")
	b.WriteString(strconv.Itoa(iv.ExpiredRequests))
	return b.String()
}

// pyRound renders round(x, decimals) the way Python's str prints the resulting float:
// correctly rounded, trailing zeros dropped but at least one decimal ("2.0", "1.25"), and
// "inf"/"nan" for non-finite values.
func pyRound(x float64, decimals int) string {
	switch {
	case math.IsNaN(x):
		return "nan"
	case math.IsInf(x, 1):
		return "inf"
	case math.IsInf(x, -1):
		return "-inf"
	}
	s := strconv.FormatFloat(x, 'f', decimals, 64)
	if strings.IndexByte(s, '.') >= 0 {
		s = strings.TrimRight(s, "0")
		if strings.HasSuffix(s, ".") {
			s += "0"
		}
	} else {
		s += ".0"
	}
	return s
}

// pairwiseSum is numpy's float64 add.reduce: pairwise summation with an 8-way unrolled
// leaf of up to 128 elements, so means match numpy to the last bit.
func pairwiseSum(a []float64) float64 {
	n := len(a)
	switch {
	case n < 8:
		var res float64 // numpy starts from -0.0; the difference is invisible after rounding
		for _, v := range a {
			res += v
		}
		return res
	case n <= 128:
		var r [8]float64
		copy(r[:], a[:8])
		i := 8
		for ; i < n-n%8; i += 8 {
			for j := range 8 {
				r[j] += a[i+j]
			}
		}
		res := ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
		for ; i < n; i++ {
			res += a[i]
		}
		return res
	default:
		n2 := n / 2
		n2 -= n2 % 8
		return pairwiseSum(a[:n2]) + pairwiseSum(a[n2:])
	}
}
