// render: a small offline stand-in for `helm template`, for tests only. It executes a chart's
// templates with Go's text/template and sprig (Debian's golang + golang-github-masterminds-
// sprig-dev, the engine Helm uses) plus Helm's documented extra functions (include, tpl,
// required, toYaml, fromYaml, toJson, fromJson, lookup) and built-in objects (.Values,
// .Release, .Chart, .Capabilities, .Template, .Files). The chart stays plain Helm.
//
//	render -chart deploy/helm/moe-serving [-f values-k3.yaml ...] [-set a.b=c ...]
//	       -release moe -namespace serving -out rendered.yaml [-notes NOTES.out]
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"text/template"

	"github.com/Masterminds/sprig"
	"gopkg.in/yaml.v3"
)

type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

// Files is .Files: Get returns a chart file's contents ("" when missing).
type Files map[string][]byte

func (f Files) Get(name string) string { return string(f[name]) }

func die(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "render: "+format+"\n", args...)
	os.Exit(1)
}

// normalize turns yaml.v3's map[string]interface{} trees into the same shapes Helm uses.
func normalize(v interface{}) interface{} {
	switch t := v.(type) {
	case map[string]interface{}:
		for k, x := range t {
			t[k] = normalize(x)
		}
		return t
	case map[interface{}]interface{}:
		m := map[string]interface{}{}
		for k, x := range t {
			m[fmt.Sprint(k)] = normalize(x)
		}
		return m
	case []interface{}:
		for i, x := range t {
			t[i] = normalize(x)
		}
		return t
	}
	return v
}

func readYaml(path string) map[string]interface{} {
	data, err := os.ReadFile(path)
	if err != nil {
		die("%v", err)
	}
	m := map[string]interface{}{}
	if err := yaml.Unmarshal(data, &m); err != nil {
		die("%s: %v", path, err)
	}
	return normalize(m).(map[string]interface{})
}

// merge overlays src onto dst (maps merge deeply, everything else replaces), as -f does.
func merge(dst, src map[string]interface{}) {
	for k, v := range src {
		if sm, ok := v.(map[string]interface{}); ok {
			if dm, ok := dst[k].(map[string]interface{}); ok {
				merge(dm, sm)
				continue
			}
		}
		dst[k] = v
	}
}

func setPath(values map[string]interface{}, assignment string) {
	eq := strings.Index(assignment, "=")
	if eq < 0 {
		die("-set %q: expected key=value", assignment)
	}
	keys := strings.Split(assignment[:eq], ".")
	var value interface{}
	if err := yaml.Unmarshal([]byte(assignment[eq+1:]), &value); err != nil || value == nil {
		value = assignment[eq+1:]
	}
	m := values
	for _, k := range keys[:len(keys)-1] {
		next, ok := m[k].(map[string]interface{})
		if !ok {
			next = map[string]interface{}{}
			m[k] = next
		}
		m = next
	}
	m[keys[len(keys)-1]] = normalize(value)
}

func toYaml(v interface{}) string {
	var buf bytes.Buffer
	enc := yaml.NewEncoder(&buf)
	enc.SetIndent(2)
	if err := enc.Encode(v); err != nil {
		return ""
	}
	return strings.TrimSuffix(buf.String(), "\n")
}

// apiVersions is Helm's .Capabilities.APIVersions: a list with Has (a group/version or a
// group/version/kind).
type apiVersions []string

func (a apiVersions) Has(v string) bool {
	for _, x := range a {
		if x == v {
			return true
		}
	}
	return false
}

func main() {
	chart := flag.String("chart", "", "chart directory")
	release := flag.String("release", "moe", "release name")
	namespace := flag.String("namespace", "default", "namespace")
	out := flag.String("out", "", "rendered manifests (multi-document YAML)")
	notes := flag.String("notes", "", "rendered NOTES.txt")
	upgrade := flag.Bool("upgrade", false, "render as `helm upgrade` does (.Release.IsUpgrade, revision 2)")
	apis := flag.String("api", "", "comma-separated API versions the cluster serves besides the built-in ones (.Capabilities.APIVersions), e.g. cert-manager.io/v1")
	var valueFiles, sets multiFlag
	flag.Var(&valueFiles, "f", "values file (repeatable)")
	flag.Var(&sets, "set", "key.path=value (repeatable)")
	flag.Parse()
	if *chart == "" || *out == "" {
		die("-chart and -out are required")
	}

	meta := readYaml(filepath.Join(*chart, "Chart.yaml"))
	values := readYaml(filepath.Join(*chart, "values.yaml"))
	for _, f := range valueFiles {
		merge(values, readYaml(f))
	}
	for _, s := range sets {
		setPath(values, s)
	}
	files := Files{}
	filepath.Walk(*chart, func(p string, info os.FileInfo, err error) error {
		if err == nil && !info.IsDir() {
			rel, _ := filepath.Rel(*chart, p)
			data, _ := os.ReadFile(p)
			files[rel] = data
		}
		return nil
	})
	chartObj := map[string]interface{}{}
	for k, v := range meta {  // .Chart.Name, .Chart.Version, .Chart.AppVersion, ...
		chartObj[strings.ToUpper(k[:1])+k[1:]] = v
	}
	name := fmt.Sprint(meta["name"])

	root := template.New("chart")
	funcs := sprig.TxtFuncMap()
	includeDepth := 0
	funcs["include"] = func(tname string, data interface{}) (string, error) {
		includeDepth++
		defer func() { includeDepth-- }()
		if includeDepth > 100 {
			return "", fmt.Errorf("include %q: recursion too deep", tname)
		}
		var buf bytes.Buffer
		err := root.ExecuteTemplate(&buf, tname, data)
		return buf.String(), err
	}
	funcs["tpl"] = func(text string, data interface{}) (string, error) {
		t, err := root.Clone()
		if err != nil {
			return "", err
		}
		t, err = t.New("tpl").Parse(text)
		if err != nil {
			return "", err
		}
		var buf bytes.Buffer
		err = t.Execute(&buf, data)
		return buf.String(), err
	}
	funcs["required"] = func(msg string, v interface{}) (interface{}, error) {
		if v == nil || v == "" {
			return nil, fmt.Errorf("%s", msg)
		}
		return v, nil
	}
	funcs["toYaml"] = toYaml
	funcs["fromYaml"] = func(s string) map[string]interface{} {
		m := map[string]interface{}{}
		if err := yaml.Unmarshal([]byte(s), &m); err != nil {
			m["Error"] = err.Error()
		}
		return normalize(m).(map[string]interface{})
	}
	funcs["toJson"] = func(v interface{}) string {
		b, err := json.Marshal(v)
		if err != nil {
			return ""
		}
		return string(b)
	}
	funcs["fromJson"] = func(s string) map[string]interface{} {
		m := map[string]interface{}{}
		if err := json.Unmarshal([]byte(s), &m); err != nil {
			m["Error"] = err.Error()
		}
		return m
	}
	funcs["lookup"] = func(string, string, string, string) map[string]interface{} {
		return map[string]interface{}{}  // as in `helm template`: no cluster to look at
	}
	root.Funcs(funcs).Option("missingkey=zero")

	var names []string
	for rel, data := range files {
		if !strings.HasPrefix(rel, "templates/") {
			continue
		}
		tname := name + "/" + rel
		if _, err := root.New(tname).Parse(string(data)); err != nil {
			die("%v", err)
		}
		base := filepath.Base(rel)
		if !strings.HasPrefix(base, "_") && (strings.HasSuffix(base, ".yaml") || base == "NOTES.txt") {
			names = append(names, tname)
		}
	}
	sort.Strings(names)

	var manifests bytes.Buffer
	for _, tname := range names {
		data := map[string]interface{}{
			"Values": values,
			"Release": map[string]interface{}{"Name": *release, "Namespace": *namespace,
				"Service": "Helm", "IsInstall": !*upgrade, "IsUpgrade": *upgrade,
				"Revision": map[bool]int{false: 1, true: 2}[*upgrade]},
			"Chart": chartObj,
			"Capabilities": map[string]interface{}{
				"KubeVersion": map[string]interface{}{"Version": "v1.29.0", "Major": "1", "Minor": "29"},
				"APIVersions": apiVersions(append([]string{"v1", "apps/v1", "monitoring.coreos.com/v1"},
					strings.FieldsFunc(*apis, func(r rune) bool { return r == ',' })...))},
			"Template": map[string]interface{}{"Name": tname, "BasePath": name + "/templates"},
			"Files":    files,
		}
		var buf bytes.Buffer
		if err := root.ExecuteTemplate(&buf, tname, data); err != nil {
			die("%v", err)
		}
		text := strings.ReplaceAll(buf.String(), "<no value>", "")
		if strings.HasSuffix(tname, "NOTES.txt") {
			if *notes != "" {
				os.WriteFile(*notes, []byte(text), 0644)
			}
			continue
		}
		for _, doc := range strings.Split(text, "\n---") {
			if strings.TrimSpace(doc) == "" {
				continue
			}
			fmt.Fprintf(&manifests, "---\n# Source: %s\n%s\n", tname, strings.Trim(doc, "\n"))
		}
	}
	if err := os.WriteFile(*out, manifests.Bytes(), 0644); err != nil {
		die("%v", err)
	}
}
