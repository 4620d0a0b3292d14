package metrics

import (
	"bufio"
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// The agent's few metrics are kept here and written in the Prometheus text
// exposition format (version 0.0.4) by hand, rather than with
// client_golang: the node binary is also the exec credential plugin, and
// every package it links (client_golang brings protobuf and procfs) is
// initialised on each of kubelet's credential calls.

// family is one metric name with its help, type and series.
type family struct {
	name, help, kind string
	label            string    // the one label of a vector, "" for a single series
	buckets          []float64 // histograms only
	fn               func() float64
	fnVec            func() map[string]float64 // by label value, read when scraped

	mu     sync.Mutex
	series map[string]*series // by label value ("" for a single series)
}

// series is one time series: a value, or a histogram's buckets.
type series struct {
	f      *family
	value  float64
	counts []uint64 // per bucket, not cumulative
	count  uint64
	sum    float64
}

func newFamily(name, help, kind, label string, buckets ...float64) *family {
	return &family{name: name, help: help, kind: kind, label: label, buckets: buckets, series: map[string]*series{}}
}

// with returns the series of a label value, creating it (at zero) if
// needed, so that a series is exposed from the moment it is known.
func (f *family) with(labelValue string) *series {
	f.mu.Lock()
	defer f.mu.Unlock()
	s, ok := f.series[labelValue]
	if !ok {
		s = &series{f: f, counts: make([]uint64, len(f.buckets))}
		f.series[labelValue] = s
	}
	return s
}

// Set implements daemon.Gauge.
func (s *series) Set(v float64) {
	s.f.mu.Lock()
	s.value = v
	s.f.mu.Unlock()
}

// Inc implements daemon.Counter.
func (s *series) Inc() {
	s.f.mu.Lock()
	s.value++
	s.f.mu.Unlock()
}

// Observe implements daemon.Histogram.
func (s *series) Observe(v float64) {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	if i, _ := slices.BinarySearch(s.f.buckets, v); i < len(s.counts) {
		s.counts[i]++
	}
	s.count++
	s.sum += v
}

// exponentialBuckets returns n upper bounds from start, each factor times
// the previous.
func exponentialBuckets(start, factor float64, n int) []float64 {
	b := make([]float64, n)
	for i := range b {
		b[i] = start
		start *= factor
	}
	return b
}

// write writes the family in the text format, series sorted by label.
func (f *family) write(w *bufio.Writer) {
	fmt.Fprintf(w, "# HELP %s %s\n# TYPE %s %s\n", f.name, escapeHelp(f.help), f.name, f.kind)
	if f.fn != nil {
		fmt.Fprintf(w, "%s %s\n", f.name, formatFloat(f.fn()))
		return
	}
	if f.fnVec != nil {
		byLabel := f.fnVec()
		values := make([]string, 0, len(byLabel))
		for v := range byLabel {
			values = append(values, v)
		}
		slices.Sort(values)
		for _, v := range values {
			fmt.Fprintf(w, "%s{%s=\"%s\"} %s\n", f.name, f.label, escapeLabel(v), formatFloat(byLabel[v]))
		}
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	values := make([]string, 0, len(f.series))
	for v := range f.series {
		values = append(values, v)
	}
	slices.Sort(values)
	for _, v := range values {
		s := f.series[v]
		labels := ""
		if f.label != "" {
			labels = f.label + `="` + escapeLabel(v) + `"`
		}
		if f.kind != "histogram" {
			fmt.Fprintf(w, "%s%s %s\n", f.name, braces(labels), formatFloat(s.value))
			continue
		}
		var cum uint64
		for i, le := range f.buckets {
			cum += s.counts[i]
			fmt.Fprintf(w, "%s_bucket%s %d\n", f.name, braces(join(labels, `le="`+formatFloat(le)+`"`)), cum)
		}
		fmt.Fprintf(w, "%s_bucket%s %d\n", f.name, braces(join(labels, `le="+Inf"`)), s.count)
		fmt.Fprintf(w, "%s_sum%s %s\n", f.name, braces(labels), formatFloat(s.sum))
		fmt.Fprintf(w, "%s_count%s %d\n", f.name, braces(labels), s.count)
	}
}

func join(a, b string) string {
	if a == "" {
		return b
	}
	return a + "," + b
}

func braces(labels string) string {
	if labels == "" {
		return ""
	}
	return "{" + labels + "}"
}

func formatFloat(v float64) string {
	switch {
	case math.IsInf(v, 1):
		return "+Inf"
	case math.IsInf(v, -1):
		return "-Inf"
	case math.IsNaN(v):
		return "NaN"
	}
	return strconv.FormatFloat(v, 'g', -1, 64)
}

var (
	labelEscaper = strings.NewReplacer(`\`, `\\`, "\n", `\n`, `"`, `\"`)
	helpEscaper  = strings.NewReplacer(`\`, `\\`, "\n", `\n`)
)

func escapeLabel(s string) string { return labelEscaper.Replace(s) }
func escapeHelp(s string) string  { return helpEscaper.Replace(s) }

// processFamilies are the process and runtime metrics Prometheus users
// expect of any Go service, read when scraped.
func processFamilies(started time.Time) []*family {
	gaugeFn := func(name, help string, fn func() float64) *family {
		f := newFamily(name, help, "gauge", "")
		f.fn = fn
		return f
	}
	cpu := newFamily("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.", "counter", "")
	cpu.fn = func() float64 {
		var ru syscall.Rusage
		if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
			return 0
		}
		return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()).Seconds()
	}
	return []*family{
		cpu,
		gaugeFn("process_start_time_seconds", "Start time of the process since unix epoch in seconds.", func() float64 {
			return float64(started.UnixNano()) / 1e9
		}),
		gaugeFn("process_resident_memory_bytes", "Resident memory size in bytes.", residentBytes),
		gaugeFn("process_open_fds", "Number of open file descriptors.", func() float64 {
			entries, err := os.ReadDir("/proc/self/fd")
			if err != nil {
				return 0
			}
			return float64(len(entries))
		}),
		gaugeFn("go_goroutines", "Number of goroutines that currently exist.", func() float64 { return float64(runtime.NumGoroutine()) }),
		gaugeFn("go_memstats_heap_alloc_bytes", "Number of heap bytes allocated and still in use.", func() float64 {
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			return float64(ms.HeapAlloc)
		}),
	}
}

// residentBytes reads the resident set size from /proc/self/statm (Linux).
func residentBytes() float64 {
	data, err := os.ReadFile("/proc/self/statm")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(data))
	if len(f) < 2 {
		return 0
	}
	pages, err := strconv.ParseFloat(f[1], 64)
	if err != nil {
		return 0
	}
	return pages * float64(os.Getpagesize())
}

// writeAll writes every family.
func writeAll(out io.Writer, families []*family) error {
	w := bufio.NewWriter(out)
	for _, f := range families {
		f.write(w)
	}
	return w.Flush()
}
