package kubernetes_test

import (
	"bufio"
	"bytes"
	"fmt"
	"log/slog"
	"maps"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/api/types"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"

	"github.com/kvbridge/kvbridge/connector"
)

// overlays are the deployments a user applies, and whether their engines transfer KV both ways.
var overlays = map[string]bool{"overlays/one-way": false, "overlays/bidirectional": true}

// objects are the decoded resources of one manifest set, by name.
type objects struct {
	services        map[string]*corev1.Service
	configMaps      map[string]*corev1.ConfigMap
	statefulSets    map[string]*appsv1.StatefulSet
	deployments     map[string]*appsv1.Deployment
	networkPolicies map[string]*networkingv1.NetworkPolicy
	pdbs            map[string]*policyv1.PodDisruptionBudget
}

func newObjects() *objects {
	return &objects{services: map[string]*corev1.Service{}, configMaps: map[string]*corev1.ConfigMap{},
		statefulSets: map[string]*appsv1.StatefulSet{}, deployments: map[string]*appsv1.Deployment{},
		networkPolicies: map[string]*networkingv1.NetworkPolicy{}, pdbs: map[string]*policyv1.PodDisruptionBudget{}}
}

// add decodes one YAML document strictly — an unknown or misspelled field is an error — into
// the Kubernetes API type its kind names.
func (o *objects) add(doc []byte) error {
	var meta struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
	}
	if err := yaml.Unmarshal(doc, &meta); err != nil {
		return err
	}
	var name string
	var err error
	switch meta.APIVersion + " " + meta.Kind {
	case "v1 Service":
		name, err = decodeInto(doc, o.services)
	case "v1 ConfigMap":
		name, err = decodeInto(doc, o.configMaps)
	case "apps/v1 StatefulSet":
		name, err = decodeInto(doc, o.statefulSets)
	case "apps/v1 Deployment":
		name, err = decodeInto(doc, o.deployments)
	case "networking.k8s.io/v1 NetworkPolicy":
		name, err = decodeInto(doc, o.networkPolicies)
	case "policy/v1 PodDisruptionBudget":
		name, err = decodeInto(doc, o.pdbs)
	default:
		return fmt.Errorf("kind %q of apiVersion %q: no decoder in this test (add one)", meta.Kind, meta.APIVersion)
	}
	if err != nil {
		return fmt.Errorf("%s %s: %w", meta.Kind, name, err)
	}
	if name == "" {
		return fmt.Errorf("a %s without a name", meta.Kind)
	}
	return nil
}

// decodeInto decodes doc strictly into a new T and files it in m under its name.
func decodeInto[T any, PT interface {
	*T
	GetName() string
}](doc []byte, m map[string]*T) (string, error) {
	v := PT(new(T))
	err := yaml.UnmarshalStrict(doc, v)
	m[v.GetName()] = v
	return v.GetName(), err
}

// splitDocs splits a YAML stream at its "---" lines, dropping empty documents.
func splitDocs(data []byte) [][]byte {
	var docs [][]byte
	for part := range strings.SplitSeq("\n"+string(data), "\n---") {
		if strings.TrimSpace(stripComments(part)) != "" {
			docs = append(docs, []byte(part))
		}
	}
	return docs
}

func stripComments(s string) string {
	var b strings.Builder
	for line := range strings.SplitSeq(s, "\n") {
		if t := strings.TrimSpace(line); t != "" && !strings.HasPrefix(t, "#") {
			b.WriteString(line + "\n")
		}
	}
	return b.String()
}

// TestManifestsDecodeStrictly decodes every YAML file here strictly: kustomizations into
// kustomize's Kustomization, everything else (resources and patches) into the Kubernetes API
// types. A field Kubernetes or kustomize does not know fails the test.
func TestManifestsDecodeStrictly(t *testing.T) {
	n := 0
	err := filepath.WalkDir(".", func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || filepath.Ext(path) != ".yaml" {
			return err
		}
		n++
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if d.Name() == "kustomization.yaml" {
			var k types.Kustomization
			if err := yaml.UnmarshalStrict(data, &k); err != nil {
				t.Errorf("%s: %v", path, err)
			}
			if k.Kind != types.KustomizationKind || k.APIVersion != types.KustomizationVersion {
				t.Errorf("%s: kind %q apiVersion %q", path, k.Kind, k.APIVersion)
			}
			return nil
		}
		o := newObjects()
		for i, doc := range splitDocs(data) {
			if err := o.add(doc); err != nil {
				t.Errorf("%s, document %d: %v", path, i+1, err)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n < 8 {
		t.Errorf("read %d YAML files; the base and the overlays have more", n)
	}
}

// build runs kustomize on dir, as `kubectl apply -k dir` would, and decodes the result strictly.
func build(t *testing.T, dir string) *objects {
	t.Helper()
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	rm, err := k.Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		t.Fatalf("kustomize build %s: %v", dir, err)
	}
	o := newObjects()
	for _, r := range rm.Resources() {
		doc, err := r.AsYAML()
		if err != nil {
			t.Fatal(err)
		}
		if err := o.add(doc); err != nil {
			t.Errorf("%s: %v", dir, err)
		}
	}
	return o
}

// TestOverlays builds each overlay with kustomize and checks that the deployment it makes fits
// together and tells kvbridge what the guide's multi-instance layout needs.
func TestOverlays(t *testing.T) {
	for dir, bidi := range overlays {
		t.Run(filepath.Base(dir), func(t *testing.T) {
			o := build(t, dir)
			for _, role := range []string{"prefill", "decode"} {
				name := "kvbridge-" + role
				sts := o.statefulSets[name]
				if sts == nil {
					t.Fatalf("no StatefulSet %s; have %v", name, slices.Sorted(maps.Keys(o.statefulSets)))
				}
				checkEngine(t, o, sts, role, bidi)
			}
			px := o.deployments["kvbridge-proxy"]
			if px == nil {
				t.Fatalf("no Deployment kvbridge-proxy; have %v", slices.Sorted(maps.Keys(o.deployments)))
			}
			checkProxy(t, o, px, bidi)
			checkServices(t, o)
			checkLabels(t, o)
			checkDisruptionAndSpread(t, o)
			checkNetworkPolicies(t, o, bidi)
			if _, redis := o.deployments["kvbridge-redis"]; redis != bidi {
				t.Errorf("a Redis deployment: %v, want %v (the multi-turn proxy tier's store)", redis, bidi)
			}
		})
	}
}

// container returns the template's only container, its environment resolved: literal values,
// ConfigMap keys (which must exist) and field references as "fieldRef:<path>".
func container(t *testing.T, o *objects, spec *corev1.PodTemplateSpec) (*corev1.Container, map[string]string) {
	t.Helper()
	if len(spec.Spec.Containers) != 1 {
		t.Fatalf("%d containers, want 1", len(spec.Spec.Containers))
	}
	c := &spec.Spec.Containers[0]
	env := map[string]string{}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			env[e.Name] = e.Value
		case e.ValueFrom.ConfigMapKeyRef != nil:
			ref := e.ValueFrom.ConfigMapKeyRef
			cm := o.configMaps[ref.Name]
			if cm == nil {
				t.Errorf("env %s: no ConfigMap %s", e.Name, ref.Name)
				continue
			}
			v, ok := cm.Data[ref.Key]
			if !ok {
				t.Errorf("env %s: ConfigMap %s has no key %s", e.Name, ref.Name, ref.Key)
			}
			env[e.Name] = v
		case e.ValueFrom.FieldRef != nil:
			env[e.Name] = "fieldRef:" + e.ValueFrom.FieldRef.FieldPath
		case e.ValueFrom.SecretKeyRef != nil: // created by the operator, never in the manifests
			env[e.Name] = "secret:" + e.ValueFrom.SecretKeyRef.Name + "/" + e.ValueFrom.SecretKeyRef.Key
		default:
			t.Errorf("env %s: a source this test does not resolve", e.Name)
		}
	}
	if sc := spec.Spec.SecurityContext; sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.RunAsUser == nil || *sc.RunAsUser == 0 {
		t.Errorf("container %s: the pod must run as a non-root user", c.Name)
	}
	return c, env
}

var varRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// expandArgs expands $(VAR) in the container's arguments as the kubelet does; every reference
// must name a variable of the container.
func expandArgs(t *testing.T, c *corev1.Container, env map[string]string) []string {
	t.Helper()
	out := make([]string, len(c.Args))
	for i, a := range c.Args {
		out[i] = varRef.ReplaceAllStringFunc(a, func(ref string) string {
			name := varRef.FindStringSubmatch(ref)[1]
			v, ok := env[name]
			if !ok {
				t.Errorf("container %s: argument %q refers to $(%s), which is not in its environment", c.Name, a, name)
			}
			return v
		})
	}
	return out
}

// flags reads `--name value` and `--name` (a switch) arguments after the subcommand.
func flags(args []string) map[string]string {
	f := map[string]string{}
	for i := 1; i < len(args); i++ {
		name, ok := strings.CutPrefix(args[i], "--")
		if !ok {
			continue
		}
		if v, val, eq := strings.Cut(name, "="); eq {
			f[v] = val
			continue
		}
		if i+1 < len(args) && !strings.HasPrefix(args[i+1], "--") {
			f[name] = args[i+1]
			i++
		} else {
			f[name] = "true"
		}
	}
	return f
}

// port returns the container's port of that name (0 if none).
func port(c *corev1.Container, name string) int32 {
	for _, p := range c.Ports {
		if p.Name == name {
			return p.ContainerPort
		}
	}
	return 0
}

// checkHTTPProbe checks that the probe GETs path on the container's http port.
func checkHTTPProbe(t *testing.T, what string, p *corev1.Probe, paths ...string) {
	t.Helper()
	if p == nil || p.HTTPGet == nil {
		t.Errorf("%s: no HTTP probe", what)
		return
	}
	if !slices.Contains(paths, p.HTTPGet.Path) || p.HTTPGet.Port.String() != "http" {
		t.Errorf("%s: probes %s on port %s; want %v on port http", what, p.HTTPGet.Path, p.HTTPGet.Port.String(), paths)
	}
}

// checkScrape checks the Prometheus scrape annotations of a pod template.
func checkScrape(t *testing.T, what string, spec *corev1.PodTemplateSpec, port int32) {
	t.Helper()
	a := spec.Annotations
	if a["prometheus.io/scrape"] != "true" || a["prometheus.io/port"] != strconv.Itoa(int(port)) || a["prometheus.io/path"] != "/metrics" {
		t.Errorf("%s: scrape annotations %v; want prometheus.io/scrape true, port %d, path /metrics", what, a, port)
	}
}

// checkEngine checks an engine StatefulSet: kvbridge serve with the guide's environment, its
// side channel at the pod IP, its config of the right role, probes, scraping, and a headless
// Service that gives each pod a DNS name.
func checkEngine(t *testing.T, o *objects, sts *appsv1.StatefulSet, role string, bidi bool) {
	t.Helper()
	c, env := container(t, o, &sts.Spec.Template)
	args := expandArgs(t, c, env)
	if len(args) < 2 || args[0] != "serve" || args[1] == "" {
		t.Fatalf("%s: args %q, want serve MODEL …", sts.Name, args)
	}
	f := flags(args)
	httpPort := port(c, "http")
	if f["port"] != strconv.Itoa(int(httpPort)) || httpPort == 0 {
		t.Errorf("%s: --port %s, container port http %d", sts.Name, f["port"], httpPort)
	}
	if env["VLLM_NIXL_SIDE_CHANNEL_HOST"] != "fieldRef:status.podIP" {
		t.Errorf("%s: VLLM_NIXL_SIDE_CHANNEL_HOST is %q; want the pod IP (downward API status.podIP)", sts.Name, env["VLLM_NIXL_SIDE_CHANNEL_HOST"])
	}
	if sc := port(c, "side-channel"); sc == 0 || env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != strconv.Itoa(int(sc)) {
		t.Errorf("%s: VLLM_NIXL_SIDE_CHANNEL_PORT %q, container port side-channel %d", sts.Name, env["VLLM_NIXL_SIDE_CHANNEL_PORT"], sc)
	}
	cfg, err := connector.ParseConfig([]byte(f["kv-transfer-config"]), slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatalf("%s: --kv-transfer-config: %v", sts.Name, err)
	}
	want := map[string]connector.Role{"prefill": connector.RoleProducer, "decode": connector.RoleConsumer}[role]
	if cfg.Role != want || cfg.Bidirectional != bidi || cfg.LoadFailurePolicy != connector.PolicyFail {
		t.Errorf("%s: kv_role %s, bidirectional %v, policy %s; want %s, %v, fail", sts.Name, cfg.Role, cfg.Bidirectional, cfg.LoadFailurePolicy, want, bidi)
	}
	if len(cfg.Backends) != 0 {
		t.Errorf("%s: backends %v; leave the choice to the transfer engine (TCP between pods)", sts.Name, cfg.Backends)
	}
	if tp := port(c, "kv-transfer"); tp == 0 || f["kv-transfer-port"] != strconv.Itoa(int(tp)) {
		t.Errorf("%s: --kv-transfer-port %q, container port kv-transfer %d", sts.Name, f["kv-transfer-port"], tp)
	}
	checkHTTPProbe(t, sts.Name+" readiness", c.ReadinessProbe, "/ready")
	checkHTTPProbe(t, sts.Name+" liveness", c.LivenessProbe, "/health")
	checkHTTPProbe(t, sts.Name+" startup", c.StartupProbe, "/health")
	checkScrape(t, sts.Name, &sts.Spec.Template, httpPort)
	svc := o.services[sts.Spec.ServiceName]
	if svc == nil || svc.Spec.ClusterIP != corev1.ClusterIPNone {
		t.Errorf("%s: serviceName %q must be a headless Service (clusterIP: None), for one DNS name per pod", sts.Name, sts.Spec.ServiceName)
	}
	if sts.Spec.Replicas == nil || *sts.Spec.Replicas != 2 {
		t.Errorf("%s: replicas %v; the guide's layout has two of each", sts.Name, sts.Spec.Replicas)
	}
}

// engineHosts checks a proxy host list against the StatefulSet it must name: every pod, by its
// DNS name (<pod>.<service>), each at the engine's HTTP port.
func engineHosts(t *testing.T, o *objects, role string, hosts, ports string) {
	t.Helper()
	sts := o.statefulSets["kvbridge-"+role]
	if sts == nil {
		return
	}
	c := &sts.Spec.Template.Spec.Containers[0]
	hl, pl := strings.Split(hosts, ","), strings.Split(ports, ",")
	var want []string
	for i := range int(*sts.Spec.Replicas) {
		want = append(want, fmt.Sprintf("%s-%d.%s", sts.Name, i, sts.Spec.ServiceName))
	}
	if !slices.Equal(hl, want) {
		t.Errorf("proxy's %s hosts %v, want every pod of %s: %v", role, hl, sts.Name, want)
	}
	if len(pl) != len(hl) {
		t.Errorf("proxy: %d %s hosts but %d ports", len(hl), role, len(pl))
	}
	for _, p := range pl {
		if p != strconv.Itoa(int(port(c, "http"))) {
			t.Errorf("proxy: %s port %s, the engines serve HTTP on %d", role, p, port(c, "http"))
		}
	}
}

// checkProxy checks the proxy Deployment: kvbridge proxy over every engine; in the
// bidirectional overlay the multi-turn proxy with a Redis store that exists, a conversation TTL
// below the decoders' hold, and its metrics scraped.
func checkProxy(t *testing.T, o *objects, d *appsv1.Deployment, bidi bool) {
	t.Helper()
	c, env := container(t, o, &d.Spec.Template)
	args := expandArgs(t, c, env)
	if len(args) == 0 || args[0] != "proxy" {
		t.Fatalf("proxy: args %q, want proxy …", args)
	}
	f := flags(args)
	httpPort := port(c, "http")
	if f["port"] != strconv.Itoa(int(httpPort)) || f["host"] != "0.0.0.0" {
		t.Errorf("proxy: --host %s --port %s; want 0.0.0.0 and the container port http %d", f["host"], f["port"], httpPort)
	}
	engineHosts(t, o, "prefill", f["prefiller-hosts"], f["prefiller-ports"])
	engineHosts(t, o, "decode", f["decoder-hosts"], f["decoder-ports"])
	if (f["multi-turn"] == "true") != bidi {
		t.Errorf("proxy: --multi-turn %q, want %v", f["multi-turn"], bidi)
	}
	checkHTTPProbe(t, "proxy readiness", c.ReadinessProbe, "/ready")
	if !bidi {
		checkHTTPProbe(t, "proxy liveness", c.LivenessProbe, "/healthcheck")
		return
	}
	checkHTTPProbe(t, "proxy liveness", c.LivenessProbe, "/health")
	checkScrape(t, "proxy", &d.Spec.Template, httpPort)
	u, err := url.Parse(f["conversation-store"])
	if err != nil || u.Scheme != "redis" {
		t.Fatalf("proxy: --conversation-store %q, want redis://HOST:PORT/DB", f["conversation-store"])
	}
	if !strings.HasPrefix(env["KVBRIDGE_CONVERSATION_STORE_KEY"], "secret:") {
		t.Errorf("proxy: a Redis store needs KVBRIDGE_CONVERSATION_STORE_KEY from a Secret (the key D's params are sealed under), got %q", env["KVBRIDGE_CONVERSATION_STORE_KEY"])
	}
	svc := o.services[u.Hostname()]
	if svc == nil || !slices.ContainsFunc(svc.Spec.Ports, func(p corev1.ServicePort) bool { return strconv.Itoa(int(p.Port)) == u.Port() }) {
		t.Errorf("proxy: --conversation-store %s names no Service with that port", u)
	}
	ttl, err := time.ParseDuration(f["conversation-ttl"])
	dcfg := decodeConfig(t, o)
	if err != nil || dcfg == nil || ttl >= dcfg.DecoderBlocksTTL {
		t.Errorf("proxy: --conversation-ttl %q must be shorter than the decoders' decoder_kv_blocks_ttl", f["conversation-ttl"])
	}
}

// decodeConfig returns the decoders' parsed --kv-transfer-config.
func decodeConfig(t *testing.T, o *objects) *connector.Config {
	t.Helper()
	sts := o.statefulSets["kvbridge-decode"]
	if sts == nil {
		return nil
	}
	c, env := container(t, o, &sts.Spec.Template)
	cfg, err := connector.ParseConfig([]byte(flags(expandArgs(t, c, env))["kv-transfer-config"]), slog.New(slog.DiscardHandler))
	if err != nil {
		return nil
	}
	return cfg
}

// checkServices checks that every Service selects the pods of one workload and targets ports
// those pods name.
func checkServices(t *testing.T, o *objects) {
	t.Helper()
	var templates []*corev1.PodTemplateSpec
	for _, s := range o.statefulSets {
		templates = append(templates, &s.Spec.Template)
	}
	for _, d := range o.deployments {
		templates = append(templates, &d.Spec.Template)
	}
	for name, svc := range o.services {
		var match []*corev1.PodTemplateSpec
		for _, tp := range templates {
			if len(svc.Spec.Selector) > 0 && labelsMatch(svc.Spec.Selector, tp.Labels) {
				match = append(match, tp)
			}
		}
		if len(match) != 1 {
			t.Errorf("Service %s selects %d workloads, want 1", name, len(match))
			continue
		}
		for _, p := range svc.Spec.Ports {
			if port(&match[0].Spec.Containers[0], p.TargetPort.String()) == 0 {
				t.Errorf("Service %s: target port %s is not a port of its pods", name, p.TargetPort.String())
			}
		}
	}
}

func labelsMatch(selector, labels map[string]string) bool {
	for k, v := range selector {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// TestDockerfile reads the Dockerfile the manifests' image comes from: a Go build stage of the
// go.mod's Go release with cgo off, building ./cmd/kvbridge, and a distroless static stage that
// runs the binary as a numeric non-root user. (Docker itself cannot run here.)
func TestDockerfile(t *testing.T) {
	data, err := os.ReadFile("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	var ins [][2]string // instruction, arguments
	var cont string
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if l, ok := strings.CutSuffix(line, "\\"); ok {
			cont += l + " "
			continue
		}
		line, cont = cont+line, ""
		op, rest, _ := strings.Cut(line, " ")
		ins = append(ins, [2]string{strings.ToUpper(op), strings.TrimSpace(rest)})
	}
	gomod, err := os.ReadFile("../../go.mod")
	if err != nil {
		t.Fatal(err)
	}
	goVersion := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindSubmatch(gomod)
	if goVersion == nil {
		t.Fatal("no go line in go.mod")
	}
	var froms []string
	cgoOff, built, copied := false, false, false
	var user, entrypoint string
	for _, in := range ins {
		switch op, arg := in[0], in[1]; op {
		case "FROM":
			froms = append(froms, arg)
		case "ENV":
			cgoOff = cgoOff || arg == "CGO_ENABLED=0"
		case "RUN":
			if strings.Contains(arg, "go build") && strings.Contains(arg, "-o /out/kvbridge ./cmd/kvbridge") {
				built = cgoOff && len(froms) == 1
			}
		case "COPY":
			copied = copied || (arg == "--from=build /out/kvbridge /kvbridge" && len(froms) == 2)
		case "USER":
			user = arg
		case "ENTRYPOINT":
			entrypoint = arg
		}
	}
	if len(froms) != 2 || froms[0] != "golang:"+string(goVersion[1])+"-bookworm AS build" || !strings.HasPrefix(froms[1], "gcr.io/distroless/static") {
		t.Errorf("stages %q: want golang:%s-bookworm AS build (go.mod's release), then gcr.io/distroless/static…", froms, goVersion[1])
	}
	if !built || !copied {
		t.Errorf("the build stage must run `go build … -o /out/kvbridge ./cmd/kvbridge` with CGO_ENABLED=0, and the final stage copy it to /kvbridge")
	}
	if uid, _, _ := strings.Cut(user, ":"); uid == "" || uid == "0" || strings.Trim(uid, "0123456789") != "" {
		t.Errorf("USER %q: want a numeric non-root user (Kubernetes' runAsNonRoot checks the number)", user)
	}
	if entrypoint != `["/kvbridge"]` {
		t.Errorf("ENTRYPOINT %s, want [\"/kvbridge\"]", entrypoint)
	}
	if _, err := os.Stat("../../cmd/kvbridge/main.go"); err != nil {
		t.Errorf("the Dockerfile builds ./cmd/kvbridge: %v", err)
	}
}
